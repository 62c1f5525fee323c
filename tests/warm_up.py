"""Warm a fresh virtual environment before the suite: ``python tests/warm_up.py`` (``make warm``; ``make test`` runs it
beside the linters, which leave the second core idle).

1. Imports the heavy libraries the suite's processes import, so Python writes their bytecode once (the Makefile
   installs packages with ``pip --no-compile``) instead of every test worker compiling the same modules at once.
2. Compiles HEAT's and SDP4Bit's numba kernels into their on-disk cache (``lightning_sdp/kernels/__pycache__``) by
   running them on tiny inputs of the types the package passes, so no test worker waits for the compilation.

Nothing here is required: a test that runs first simply compiles what it needs itself.
"""

from __future__ import annotations

import importlib
import os
import time

HEAVY = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "torchmetrics",
    "torchvision",
    "open_clip",
    "h5py",
    "numba",
    "scipy.signal",
    "sklearn",
    "triton",
    "matplotlib.pyplot",
    "yaml",
    "jsonargparse",
    "lightning_sdp",
    "lightning_sdp.cli",
)


def import_heavy() -> None:
    for name in HEAVY:
        try:
            importlib.import_module(name)
        except Exception:  # an extra that is not installed, or a library that needs a device: nothing to warm
            pass


def compile_kernels() -> None:
    """One tiny fit per specialisation of the fused kernel (plain CCL; softmax with clipping), through the package's
    own call path, so the cached signatures are the ones the tests and users hit."""
    try:
        import numba  # noqa: F401
    except ImportError:  # the cpu extra is not installed: no kernel to compile
        return
    import logging

    from lightning.pytorch import Trainer

    from lightning_sdp import InteractionsDataModule, SimpleXModule

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    settings = (
        {"row_norm": 1.0, "dropout": 0.1},  # CCL, with the row projection and the dropout mask kernels
        {"loss": "softmax", "grad_clip": 0.1},
    )
    for extra in settings:
        data = InteractionsDataModule(num_users=64, num_items=32, batch_size=64)
        model = SimpleXModule(dim=8, num_negatives=4, backend="fused", **extra)
        trainer = Trainer(
            accelerator="cpu",
            max_steps=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
    compile_codec()


def compile_codec() -> None:
    """SDP4Bit's numba codec: each kernel once (its arguments have one type signature whatever the format)."""
    import torch

    from lightning_sdp.kernels import numba_quant
    from lightning_sdp.kernels.quantization import QuantFormat

    fmt = QuantFormat(4, 64)
    x = torch.randn(128)
    payload, scales = numba_quant.encode(x, fmt, reference=torch.zeros(128))
    numba_quant.dequantize_add_(x, payload, scales, fmt)
    rows, row_scales = payload.expand(2, -1).contiguous(), scales.expand(2, -1).contiguous()
    numba_quant.dequantize_sum_requantize(rows, row_scales, fmt, fmt)
    numba_quant.dequantize_sum_hadamard(rows, row_scales, fmt, 32)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as the suite sets it (tests/conftest.py)
    start = time.perf_counter()
    import_heavy()
    imported = time.perf_counter()
    compile_kernels()
    print(f"warm-up: imports {imported - start:.1f} s, kernels {time.perf_counter() - imported:.1f} s")


if __name__ == "__main__":
    main()
