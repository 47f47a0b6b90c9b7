"""commgate: regression harness for the communication behaviour of distributed transformer training.

Data flows one way: scenario -> expectation -> run -> capture -> comparison -> report.
This package top level stays import-light (no torch, no deepspeed) so that the CLI's
``predict`` and the pytest plugin load fast.
"""

__version__ = "0.1.0"
