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
import importlib.util
import os
import sys
import tempfile
import time
import traceback

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


# plain CCL (loss_options None), with the row projection and the dropout mask kernels; the loss is named: "auto"
# picks softmax on data this dense, and the plain specialisation would never be cached
PLAIN = {"loss": "ccl", "grad_clip": None, "row_norm": 1.0, "dropout": 0.1}
SOFTMAX = {"loss": "softmax", "grad_clip": 0.1}


def start_softmax_compile() -> int | None:
    """Fork a child that compiles the softmax specialisation (``None``: numba is not installed).

    It forks before this process imports anything heavy (no thread pool exists yet), so the child's compilation
    runs on the second core while this process writes the libraries' bytecode and then compiles the plain
    specialisation and the codec.
    """
    if importlib.util.find_spec("numba") is None:  # the cpu extra is not installed: no kernel to compile
        return None
    child = os.fork()
    if child == 0:  # the child leaves without running the parent's exit hooks
        code = 1
        try:
            _take_turns_saving()
            _fit_once(SOFTMAX, plain=False)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return child


def compile_kernels(softmax_child: int | None) -> None:
    """One tiny fit per specialisation of the fused kernel (plain CCL; softmax with clipping), through the package's
    own call path, so the cached signatures are the ones the tests and users hit.

    numba compiles each specialisation for tens of seconds of CPU, so the softmax one compiles in a child forked at the
    start (:func:`start_softmax_compile`) while this process compiles the plain one and the codec; their saves to the
    kernel's shared cache index take turns (:func:`_take_turns_saving`).
    """
    if softmax_child is None:
        return
    _take_turns_saving()
    _fit_once(PLAIN, plain=True)
    compile_codec()
    _, status = os.waitpid(softmax_child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("warm-up: compiling the softmax specialisation failed (see above)")


def _fit_once(settings: dict, plain: bool) -> None:
    """One step of a tiny fit with ``settings``; raises unless it ran the plain-CCL specialisation iff ``plain``."""
    import logging

    from lightning.pytorch import Trainer
    from numba.core import types

    from lightning_sdp import InteractionsDataModule, SimpleXModule
    from lightning_sdp.kernels import cf_numba

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data = InteractionsDataModule(num_users=64, num_items=32, batch_size=64)
    model = SimpleXModule(dim=8, num_negatives=4, backend="fused", **settings)
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
    # the last argument, ``loss_options``, is None in the plain specialisation and a tuple in the other
    ran = [sig[-1] == types.none for sig in cf_numba._fused_sgd_kernel.signatures]
    if ran != [plain]:
        raise RuntimeError(f"warm-up: {settings} ran {ran} (plain-CCL specialisation?), expected [{plain}]")


def _take_turns_saving() -> None:
    """Hold a lock file while numba saves a compiled kernel: its cache index is read, extended and rewritten on every
    save, so two processes saving at once could both claim the same data file (numba itself does not lock)."""
    import fcntl

    from numba.core import caching

    save = caching.IndexDataCacheFile.save
    lock_path = os.path.join(tempfile.gettempdir(), "lightning_sdp_warm_up.lock")

    def save_in_turn(self, key, data):  # type: ignore[no-untyped-def]
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return save(self, key, data)

    caching.IndexDataCacheFile.save = save_in_turn


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
    softmax_child = start_softmax_compile()
    import_heavy()
    imported = time.perf_counter()
    compile_kernels(softmax_child)
    print(f"warm-up: imports {imported - start:.1f} s, kernels {time.perf_counter() - imported:.1f} s")


if __name__ == "__main__":
    main()
