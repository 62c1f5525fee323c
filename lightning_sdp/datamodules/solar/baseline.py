"""The baseline SOLAR is compared with: a map-style dataset reading one sample per ``__getitem__`` with h5py.

This is what a plain PyTorch project does with an HDF5 training set (``DataLoader(dataset, shuffle=True)``), and
what the demo and the SOLAR benchmarks measure :class:`~lightning_sdp.datamodules.solar.SolarDataModule` against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_sdp._imports import require
from lightning_sdp.datamodules.solar.reader import StorageThrottle, ThrottledFile


class PerSampleHDF5Dataset(Dataset):
    """``__getitem__(i)`` reads row ``i`` of the input and every target dataset with plain h5py indexing.

    Items are ``(input, target)``: the targets are joined along their first per-sample axis, so that after the
    default collate a batch holds the same tensors as a ``SolarDataModule`` dict batch's ``input`` and ``target``
    (one target keeps its own shape). The file is opened lazily in the process that reads (each DataLoader worker
    opens its own handle) and is never pickled.

    Args:
        path: the HDF5 file.
        input_key: dataset holding the inputs (first axis = samples).
        target_keys: datasets holding the targets, in order.
        throttle: emulate shared storage: every read request through the file costs this throttle's latency and
            bandwidth (see :class:`~lightning_sdp.datamodules.solar.StorageThrottle`); ``StorageThrottle()`` costs
            nothing and only counts (:attr:`bytes_read`, :attr:`requests`). Default None (plain file, not counted).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        input_key: str,
        target_keys: Sequence[str],
        throttle: StorageThrottle | None = None,
    ) -> None:
        require("h5py", feature="PerSampleHDF5Dataset")
        import h5py

        self.path, self.input_key, self.target_keys = os.fspath(path), input_key, list(target_keys)
        if not self.target_keys:
            raise ValueError("target_keys must name at least one dataset")
        self.throttle = throttle
        with h5py.File(self.path, "r") as f:
            missing = [k for k in (input_key, *self.target_keys) if k not in f]
            if missing:
                raise KeyError(f"{self.path!r} has no dataset {missing}; it holds {sorted(f)}")
            self.num_samples = int(f[input_key].shape[0])
        self._file: Any = None
        self._fileobj: ThrottledFile | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes read through the file in this process (h5py's metadata reads included); 0 without a throttle."""
        return self._fileobj.bytes_read if self._fileobj is not None else 0

    @property
    def requests(self) -> int:
        """Read requests issued to the file in this process (h5py's metadata reads included); 0 without a throttle."""
        return self._fileobj.requests if self._fileobj is not None else 0

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._file is None:
            import h5py

            if self.throttle is not None:
                self._fileobj = ThrottledFile(self.path, self.throttle)
            self._file = h5py.File(self._fileobj if self._fileobj is not None else self.path, "r")
        x = torch.from_numpy(self._file[self.input_key][i])
        targets = [torch.from_numpy(self._file[k][i]) for k in self.target_keys]
        return x, targets[0] if len(targets) == 1 else torch.cat(targets, dim=0)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_file"] = state["_fileobj"] = None  # open handles cannot travel to a worker; each opens its own
        return state
