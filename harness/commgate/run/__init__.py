"""Layer 2, running: the launcher and rank body, the interposing process group, capture records,
the training workloads on the real frameworks, and planted faults."""
