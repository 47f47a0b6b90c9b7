"""Repository-wide pytest configuration.

``pytester`` drives the commgate plugin end to end in the plugin's own tests.
"""

pytest_plugins = ["pytester"]
