"""A deterministic, PtychoNN-like synthetic HDF5 data set: far-field diffraction of random phase objects.

Each sample is a smooth random complex object ``O = A * exp(i * phi)`` (amplitude ``A`` in ``[0.6, 1]``, phase
``phi`` in ``[-max_phase, max_phase]``) lit by a Gaussian probe ``p``. The input is the far-field diffraction
pattern ``I = |FFT(O * p)|^2`` (centred, scaled to ``photons`` expected counts, Poisson noise, then
``log1p(I) / log1p(photons)``); the targets are ``A`` and ``phi``, as in PtychoNN (Cherukara et al., 2020), which
learns to invert the diffraction pattern to amplitude and phase.

Datasets written (float32, contiguous layout unless ``chunk_samples`` is given):
``diffraction (N, 1, S, S)``, ``amplitude (N, 1, S, S)``, ``phase (N, 1, S, S)``.

Run ``python -m lightning_sdp.datamodules.solar.ptycho --out ptycho.h5 --num-samples 4096`` to make one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lightning_sdp._files import atomic_path

INPUT_KEY = "diffraction"
TARGET_KEYS = ("amplitude", "phase")


def _smooth_fields(rng: np.random.Generator, n: int, size: int, correlation: float) -> np.ndarray:
    """``n`` smooth random fields in ``[0, 1]``: white noise low-passed with a Gaussian of ``correlation`` px."""
    noise = rng.standard_normal((n, size, size))
    freq = np.fft.fftfreq(size)
    kx, ky = np.meshgrid(freq, freq, indexing="ij")
    lowpass = np.exp(-2 * (np.pi * correlation) ** 2 * (kx**2 + ky**2))
    field = np.fft.ifft2(np.fft.fft2(noise) * lowpass).real
    lo = field.min(axis=(1, 2), keepdims=True)
    hi = field.max(axis=(1, 2), keepdims=True)
    return (field - lo) / np.maximum(hi - lo, 1e-12)


def simulate_ptycho(
    num_samples: int,
    size: int = 64,
    seed: int = 0,
    max_phase: float = np.pi / 2,
    probe_sigma: float | None = None,
    photons: float = 1e6,
    correlation: float = 3.0,
) -> dict[str, np.ndarray]:
    """Generate samples in memory (see the module docstring for the physics).

    Args:
        num_samples: samples to make.
        size: side of the square patches in pixels. Default 64.
        seed: seed; the same seed gives the same arrays. Default 0.
        max_phase: largest absolute phase in radians. Default pi/2.
        probe_sigma: Gaussian probe width in pixels. Default ``size / 5``.
        photons: expected total photon count of a pattern (Poisson noise); ``0`` disables noise. Default 1e6.
        correlation: correlation length of the random object in pixels. Default 3.

    Returns:
        ``{"diffraction", "amplitude", "phase"}`` arrays of shape ``(num_samples, 1, size, size)``, float32.
    """
    if num_samples < 1 or size < 4:
        raise ValueError(f"need num_samples >= 1 and size >= 4, got {num_samples} and {size}")
    rng = np.random.default_rng(seed)
    sigma = size / 5 if probe_sigma is None else probe_sigma
    axis = np.arange(size) - (size - 1) / 2
    xx, yy = np.meshgrid(axis, axis, indexing="ij")
    probe = np.exp(-(xx**2 + yy**2) / (2 * sigma**2))
    amplitude = 0.6 + 0.4 * _smooth_fields(rng, num_samples, size, correlation)
    phase = max_phase * (2 * _smooth_fields(rng, num_samples, size, correlation) - 1)
    exit_wave = probe * amplitude * np.exp(1j * phase)
    intensity = np.abs(np.fft.fftshift(np.fft.fft2(exit_wave), axes=(1, 2))) ** 2
    intensity /= intensity.sum(axis=(1, 2), keepdims=True)
    if photons > 0:
        counts = rng.poisson(intensity * photons).astype(np.float64)
        diffraction = np.log1p(counts) / np.log1p(photons)
    else:
        diffraction = np.log1p(intensity * 1e6) / np.log1p(1e6)
    return {
        INPUT_KEY: diffraction[:, None].astype(np.float32),
        "amplitude": amplitude[:, None].astype(np.float32),
        "phase": phase[:, None].astype(np.float32),
    }


def make_ptycho_h5(
    path: str | os.PathLike,
    num_samples: int = 2048,
    size: int = 64,
    seed: int = 0,
    chunk_samples: int | None = None,
    block: int = 512,
    overwrite: bool = False,
    **physics: float,
) -> Path:
    """Write a PtychoNN-like HDF5 set to ``path``; the content depends only on the arguments.

    The file appears whole or not at all: it is written under a temporary name in the same folder and renamed to
    ``path`` at the end (an error or interruption removes the temporary file and leaves an existing ``path`` as
    it was).

    Args:
        path: output file (parent folders are created).
        num_samples: samples. Default 2048.
        size: patch side in pixels. Default 64.
        seed: seed. Default 0.
        chunk_samples: HDF5 chunk length in samples; ``None`` (default) writes a contiguous layout, the best for
            coalesced reads.
        block: samples generated per block (memory bound). Default 512.
        overwrite: replace an existing file. Default False (raises ``FileExistsError``).
        **physics: ``max_phase``, ``probe_sigma``, ``photons``, ``correlation`` of :func:`simulate_ptycho`.

    Returns:
        The path written.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written into a fresh private folder in the target folder, then renamed over ``path`` in one step: a reader never
    # sees half a file, and no file or link planted beforehand is written to.
    with atomic_path(path) as tmp, open(tmp, "w+b") as fh:
        _write_ptycho(fh, num_samples, size, seed, chunk_samples, block, physics)
    return path


def _write_ptycho(
    fh: BinaryIO, num_samples: int, size: int, seed: int, chunk_samples: int | None, block: int, physics: dict[str, Any]
) -> None:
    """Write the datasets of :func:`make_ptycho_h5` into the open file ``fh``, one block of samples at a time."""
    import h5py

    shape = (num_samples, 1, size, size)
    chunks = (min(chunk_samples, num_samples), 1, size, size) if chunk_samples else None
    seeds = np.random.SeedSequence(seed).spawn(-(-num_samples // block))
    with h5py.File(fh, "w") as f:
        dsets = {k: f.create_dataset(k, shape=shape, dtype="float32", chunks=chunks) for k in (INPUT_KEY, *TARGET_KEYS)}
        for b, ss in enumerate(seeds):
            lo, hi = b * block, min((b + 1) * block, num_samples)
            data = simulate_ptycho(hi - lo, size, seed=int(ss.generate_state(1)[0]), **physics)
            for k, d in dsets.items():
                d[lo:hi] = data[k]
        f.attrs["generator"] = "lightning_sdp.datamodules.solar.ptycho"
        f.attrs["seed"] = seed
        f.attrs["input_formula"] = "log1p(Poisson(photons * |FFT(probe * A * exp(i*phi))|^2 / sum)) / log1p(photons)"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m lightning_sdp.datamodules.solar.ptycho --out ptycho.h5 [--num-samples N] ...``."""
    parser = argparse.ArgumentParser(
        prog="lightning_sdp.datamodules.solar.ptycho",
        description="Write a deterministic PtychoNN-like HDF5 set (diffraction -> amplitude, phase).",
    )
    parser.add_argument("--out", required=True, help="output .h5 file")
    parser.add_argument("--num-samples", type=int, default=2048)
    parser.add_argument("--size", type=int, default=64, help="patch side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-samples", type=int, default=None, help="HDF5 chunk length (default: contiguous)")
    parser.add_argument("--photons", type=float, default=1e6, help="expected photons per pattern (0: no noise)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        path = make_ptycho_h5(
            args.out,
            num_samples=args.num_samples,
            size=args.size,
            seed=args.seed,
            chunk_samples=args.chunk_samples,
            overwrite=args.overwrite,
            photons=args.photons,
        )
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mib = path.stat().st_size / 2**20
    print(f"wrote {path} ({args.num_samples} samples of {args.size}x{args.size}, {mib:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
