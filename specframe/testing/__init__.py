"""The exactness conformance suite (see conformance.py); `pytest_plugins = ["specframe.testing.pytest_plugin"]`."""
