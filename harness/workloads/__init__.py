"""Training workloads run under capture: the model and one module per framework (torch imported here only)."""
