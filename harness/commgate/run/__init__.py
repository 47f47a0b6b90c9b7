"""Layer 2, running: the launcher, the diagnosis of a failed run and the rank body, the interposing
process group and its recorder, capture records, the training workloads on the real frameworks, and
planted faults."""
