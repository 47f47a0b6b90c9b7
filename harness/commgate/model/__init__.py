"""Layer 1, the model: the scenario language, model presets and parameter inventory, the paper's
equations, rank layout, the collective-op table, the per-collective expectation and one module per
parallelism-scheme component. Pure Python: no torch, no deepspeed."""
