"""Test helper: ``SolarDataModule`` with its read options given as keywords beside the others."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_sdp.datamodules.solar import SolarDataModule, SolarReadOptions

READ_OPTIONS = {field.name for field in dataclasses.fields(SolarReadOptions)}


def solar_datamodule(path: Any, **kwargs: Any) -> SolarDataModule:
    """``SolarDataModule(path, ..., reads=SolarReadOptions(<the read options among kwargs>))``."""
    reads = {k: kwargs.pop(k) for k in list(kwargs) if k in READ_OPTIONS}
    return SolarDataModule(str(path), reads=SolarReadOptions(**reads) if reads else None, **kwargs)
