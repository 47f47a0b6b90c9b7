"""The trainers' adapters: one module each, run on a rank (``commgate.run.workloads.TRAINER_WORKLOADS``
names them). An adapter imports its trainer, applies the workarounds a CPU run needs (each with a test
that fails when upstream changes), builds the trainer's own job as the scenario describes it, checks that
the job built is that one, and steps it."""
