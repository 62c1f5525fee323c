"""Adapters to optional third-party libraries, importable from every layer of the package.

A module here imports only its library (lazily, inside functions, when it is an optional extra) and
``lightning_sdp._imports``; never ``callbacks``, ``models``, ``plugins`` or ``datamodules``, so datamodules and
models can both use it without an import pointing up.
"""
