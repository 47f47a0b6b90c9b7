"""Repository-wide pytest configuration.

``pytester`` drives the commgate plugin end to end in the plugin's own tests.
"""

pytest_plugins = ["pytester"]

# The malformed-scenario corpus is read by tests/test_malformed.py, not collected by the gate.
collect_ignore = ["tests/data"]
