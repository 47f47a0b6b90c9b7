"""The trainers' adapters, one module each (``commgate.run.workloads.TRAINER_WORKLOADS`` names them). An
adapter imports its trainer, applies the workarounds a CPU run needs (each named with the upstream line it works
around, with a test that fails when upstream changes), builds the trainer's own job as the scenario describes
it, steps it (or lets it run its own loop: ``commgate.run.workloads.OwnLoop``), and checks that the job built
was the one its scenario says."""
