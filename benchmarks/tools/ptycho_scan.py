"""A PtychoNN-like HDF5 set in acquisition order: overlapping probe positions of one raster scan over a large object.

A ptychography experiment moves the probe over the sample in small steps and writes each diffraction pattern as it
comes, so neighbouring rows of the file are neighbouring scan positions: their patches overlap and look alike. Across
the scan the object changes too (here its phase range grows from one side to the other and its texture coarsens), so
a contiguous run of rows is a biased sample of the whole set. A loader that shuffles chunks or shards instead of
samples feeds the model batches drawn from a few such runs.

Datasets (float32, contiguous): ``diffraction (N, 1, S, S)`` (the input, ``log1p`` of Poisson counts), ``amplitude``
and ``phase`` (the targets), in scan order (row by row, left to right). Deterministic from the seed.

    python -m benchmarks.tools.ptycho_scan --out scan.h5 --gib 1
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import numpy as np

KEYS = ("diffraction", "amplitude", "phase")


def scan_grid(num_samples: int) -> tuple[int, int]:
    """``(rows, columns)`` of a near-square raster with at least ``num_samples`` positions."""
    cols = math.ceil(math.sqrt(num_samples))
    return math.ceil(num_samples / cols), cols


def _smooth(rng: np.random.Generator, shape: tuple[int, int], correlation: float) -> np.ndarray:
    """A smooth random field in [0, 1] (white noise low-passed with a Gaussian of ``correlation`` pixels)."""
    noise = rng.standard_normal(shape)
    fx, fy = np.meshgrid(np.fft.fftfreq(shape[0]), np.fft.fftfreq(shape[1]), indexing="ij")
    field = np.fft.ifft2(np.fft.fft2(noise) * np.exp(-2 * (np.pi * correlation) ** 2 * (fx**2 + fy**2))).real
    return (field - field.min()) / max(float(np.ptp(field)), 1e-12)


def make_object(rows: int, cols: int, size: int, step: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Amplitude and phase of the scanned object (its phase range grows along the scan, its texture coarsens)."""
    rng = np.random.default_rng(seed)
    shape = ((rows - 1) * step + size, (cols - 1) * step + size)
    fine, coarse = _smooth(rng, shape, 2.0), _smooth(rng, shape, 8.0)
    along = np.linspace(0.0, 1.0, shape[0])[:, None]  # 0 at the first scan row, 1 at the last
    texture = (1 - along) * fine + along * coarse
    amplitude = 0.6 + 0.4 * _smooth(rng, shape, 4.0)
    phase = (0.15 + 0.85 * along) * np.pi / 2 * (2 * texture - 1)
    return amplitude, phase


def simulate_block(
    amplitude: np.ndarray, phase: np.ndarray, positions: np.ndarray, size: int, photons: float, seed: int
) -> dict[str, np.ndarray]:
    """The patterns of the scan positions ``positions`` (``(n, 2)`` pixel corners), in that order."""
    rng = np.random.default_rng(seed)
    axis = np.arange(size) - (size - 1) / 2
    xx, yy = np.meshgrid(axis, axis, indexing="ij")
    probe = np.exp(-(xx**2 + yy**2) / (2 * (size / 5) ** 2))
    amp = np.stack([amplitude[r : r + size, c : c + size] for r, c in positions])
    ph = np.stack([phase[r : r + size, c : c + size] for r, c in positions])
    intensity = np.abs(np.fft.fftshift(np.fft.fft2(probe * amp * np.exp(1j * ph)), axes=(1, 2))) ** 2
    intensity /= intensity.sum(axis=(1, 2), keepdims=True)
    diffraction = np.log1p(rng.poisson(intensity * photons)) / np.log1p(photons)
    return {
        "diffraction": diffraction[:, None].astype(np.float32),
        "amplitude": amp[:, None].astype(np.float32),
        "phase": ph[:, None].astype(np.float32),
    }


def make_scan_h5(
    path: str | os.PathLike,
    num_samples: int,
    size: int = 64,
    step: int = 4,
    seed: int = 0,
    photons: float = 1e6,
    block: int = 1024,
) -> Path:
    """Write ``num_samples`` scan positions in acquisition order to ``path`` (replacing it) and return the path."""
    import h5py

    from lightning_sdp._files import atomic_path

    rows, cols = scan_grid(num_samples)
    amplitude, phase = make_object(rows, cols, size, step, seed)
    corners = np.array([(r * step, c * step) for r in range(rows) for c in range(cols)][:num_samples])
    path = Path(path)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        dsets = {k: f.create_dataset(k, (num_samples, 1, size, size), dtype=np.float32) for k in KEYS}
        for start in range(0, num_samples, block):
            part = simulate_block(amplitude, phase, corners[start : start + block], size, photons, seed + 1 + start)
            for key in KEYS:
                dsets[key][start : start + len(part[key])] = part[key]
        f.attrs["order"] = "acquisition (raster scan, row by row)"
        f.attrs["scan_grid"] = (rows, cols)
    return path


def samples_for(gib: float, size: int = 64) -> int:
    """Samples whose three float32 datasets take ``gib`` GiB."""
    return math.ceil(gib * 2**30 / (len(KEYS) * size * size * 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gib", type=float, default=1.0, help="file size in GiB (default 1)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_scan_h5(args.out, samples_for(args.gib, args.size), args.size, seed=args.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
