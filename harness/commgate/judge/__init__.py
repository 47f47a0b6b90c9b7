"""Layer 3, judging: reconcile a capture with the model, the gate (paper, baseline, drift), stored
baselines, and the A/B compare of two runs."""
