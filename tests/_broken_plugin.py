"""A plugin module that fails on import, for the registration tests."""

raise ImportError("this plugin is broken on purpose")
