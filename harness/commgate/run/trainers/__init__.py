"""Trainers that run a job as its user runs it, with their own loop (``commgate.run.workloads.OwnLoop``): one
module each, with the workarounds a CPU run needs (each named with the upstream line it works around) and
the check, after the run, that the job was what its scenario says. The registry is
``commgate.run.workloads.TRAINER_WORKLOADS``."""
