"""Examples of what a user hands commgate (``model.module``, ``workload``)."""
