"""SDP4Bit fused kernels (Triton on a GPU, numba on the CPU): equality with the torch reference and bandwidth.

For each fused kernel the script checks the result against the plain-torch reference (bit-exact with explicit
rounding offsets; dequantise-sum-Hadamard to float tolerance), then times it at ``--numel`` elements (64M by
default) and reports the achieved bandwidth, counted as bytes read + written, next to the card's measured copy
bandwidth (``torch.Tensor.copy_`` of an fp32 buffer) and beside the plain-torch reference codec doing the same work
on the same device. The target: at least half of the copy bandwidth.
Writes ``benchmarks/results/sdp4bit_kernels.{json,md}``.

    .venv/bin/python -m benchmarks.sdp4bit_kernels                 # on a GPU
    .venv/bin/python -m benchmarks.sdp4bit_kernels --backend numba --threads 1   # the CPU codec, one core
    TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.sdp4bit_kernels --quick   # CPU smoke run of the script only

``--backend numba`` times the numba kernels on CPU tensors (4M elements by default, about the gradient of the
benchmark GPT; the copy bandwidth is measured with the same number of threads) and writes
``sdp4bit_kernels_cpu.*``. ``--quick`` uses a few thousand elements (the CPU interpreter is slow) and writes
``sdp4bit_kernels_quick.*``; its timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.benchmark import Timer

from benchmarks._common import markdown_table, write_results


def _time(fn: Callable[[], object], min_run_time: float) -> tuple[float, float]:
    """Median and interquartile range of one call, in seconds (``torch.utils.benchmark``: CUDA is synchronised)."""
    fn()  # compile / warm up
    measurement = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time
    )
    return measurement.median, measurement.iqr


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("triton", "numba"), default=None, help="default: triton on a GPU")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of torch and numba (numba backend)")
    parser.add_argument("--numel", type=int, default=None, help="default 64M on a GPU, 4M with numba")
    parser.add_argument("--peers", type=int, default=2, help="K contributions summed by the receive kernels")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds of timing per kernel")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default=None, help="stem of the files in benchmarks/results/ (default by backend)")
    args = parser.parse_args(argv)
    from lightning_sdp.kernels import quantization as ref
    from lightning_sdp.kernels.quantization import QuantFormat, RoundingSource

    backend = args.backend or ("triton" if torch.cuda.is_available() or args.quick else "numba")
    if backend == "numba":
        from lightning_sdp.kernels import numba_quant as tq

        device = torch.device("cpu")
        if args.threads:
            torch.set_num_threads(args.threads)
        args.threads = torch.get_num_threads()
        args.numel = args.numel or 4 * 2**20
    else:
        from lightning_sdp.kernels import triton_quant as tq  # type: ignore[no-redef]

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu" and not args.quick:
            raise SystemExit("No CUDA device: --backend numba times the CPU codec; --quick smoke-tests this script.")
        args.numel = args.numel or 64 * 2**20
    args.backend = backend
    if args.quick:
        args.numel, args.min_run_time = 2 * 2048, 0.01
    n, k = args.numel, args.peers
    w4, g4, g8 = QuantFormat(4, 2048), QuantFormat(4, 128), QuantFormat(8, 128)
    g = torch.Generator(device=device).manual_seed(0)
    master = torch.randn(n, device=device, generator=g)
    model = master + 0.01 * torch.randn(n, device=device, generator=g)
    grad = torch.randn(n, device=device, generator=g)
    noise = torch.rand(n, device=device, generator=g)

    # correctness on a slice (reference is slow on big inputs)
    m = min(n, 2**20)
    checks = {}
    u = RoundingSource(noise=noise[:m])
    a = tq.encode(master[:m], w4, u, reference=model[:m])
    b = ref.quantize_difference(master[:m], model[:m], w4, u)
    checks["subtract+quantise (qWD, 4-bit)"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    tgt = model[:m].clone()
    checks["dequantise+add"] = bool(
        torch.equal(tq.dequantize_add_(tgt.clone(), *b, w4), ref.dequantize_add_(tgt.clone(), *b, w4))
    )
    ha = tq.encode(grad[:m], g8, u, hadamard_size=32)
    hb = ref.hadamard_quantize(grad[:m], g8, 32, u)
    diff = (ha[0].view(torch.int8).int() - hb[0].view(torch.int8).int()).abs()
    checks["Hadamard+quantise (8-bit)"] = bool(diff.max() <= 1 and (diff > 0).float().mean() < 1e-3)
    rows8 = torch.stack([ref.encode(grad[:m].roll(i), g8, "nearest")[0] for i in range(k)])
    sc8 = torch.stack([ref.encode(grad[:m].roll(i), g8, "nearest")[1] for i in range(k)])
    r1 = tq.dequantize_sum_requantize(rows8, sc8, g8, g4, u)
    r2 = ref.dequantize_sum_requantize(rows8, sc8, g8, g4, u)
    checks["dequantise+sum+requantise (8->4)"] = bool(torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1]))
    rows4 = torch.stack([r1[0]] * k)
    sc4 = torch.stack([r1[1]] * k)
    checks["dequantise+sum+inverse Hadamard"] = bool(
        torch.allclose(
            tq.dequantize_sum_hadamard(rows4, sc4, g4, 32),
            ref.dequantize_sum_hadamard(rows4, sc4, g4, 32),
            rtol=1e-5,
            atol=1e-5,
        )
    )

    # bandwidth at n elements: bytes read + written per call (in-kernel stochastic rounding, as in training)
    p4, s4 = tq.encode(master, w4, reference=model)
    p8 = torch.stack([tq.encode(grad.roll(i), g8, hadamard_size=32)[0] for i in range(k)])
    s8 = torch.stack([tq.encode(grad.roll(i), g8, hadamard_size=32)[1] for i in range(k)])
    q4, t4 = tq.dequantize_sum_requantize(p8, s8, g8, g4)
    q4k, t4k = torch.stack([q4] * k), torch.stack([t4] * k)
    target = model.clone()
    copy_dst = torch.empty_like(master)
    gw, gg = w4.group_size, g8.group_size
    cases = {
        "copy fp32 (baseline)": (lambda: copy_dst.copy_(master), 8 * n),
        "subtract+quantise (qWD, 4-bit)": (
            lambda: tq.encode(master, w4, reference=model),
            8 * n + n // 2 + 4 * n // gw,
        ),
        "dequantise+add (4-bit)": (lambda: tq.dequantize_add_(target, p4, s4, w4), n // 2 + 4 * n // gw + 8 * n),
        "Hadamard+quantise (8-bit)": (lambda: tq.encode(grad, g8, hadamard_size=32), 4 * n + n + 4 * n // gg),
        f"dequantise {k}+sum+requantise (8->4)": (
            lambda: tq.dequantize_sum_requantize(p8, s8, g8, g4),
            k * (n + 4 * n // gg) + n // 2 + 4 * n // gg,
        ),
        f"dequantise {k}+sum+inverse Hadamard (4-bit)": (
            lambda: tq.dequantize_sum_hadamard(q4k, t4k, g4, 32),
            k * (n // 2 + 4 * n // gg) + 4 * n,
        ),
    }

    # the plain-torch reference codec doing the same work on the same device (its rounding noise drawn per call,
    # as the torch backend does in training)
    def rng() -> RoundingSource:
        return RoundingSource(noise=torch.rand(n, device=device))

    references = {
        "subtract+quantise (qWD, 4-bit)": lambda: ref.quantize_difference(master, model, w4, rng()),
        "dequantise+add (4-bit)": lambda: ref.dequantize_add_(target, p4, s4, w4),
        "Hadamard+quantise (8-bit)": lambda: ref.hadamard_quantize(grad, g8, 32, rng()),
        f"dequantise {k}+sum+requantise (8->4)": lambda: ref.dequantize_sum_requantize(p8, s8, g8, g4, rng()),
        f"dequantise {k}+sum+inverse Hadamard (4-bit)": lambda: ref.dequantize_sum_hadamard(q4k, t4k, g4, 32),
    }
    rows = []
    copy_bw = None
    for name, (fn, nbytes) in cases.items():
        sec, iqr = _time(fn, args.min_run_time)
        bw = nbytes / sec / 1e9
        copy_bw = copy_bw or bw
        ref_sec = _time(references[name], args.min_run_time)[0] if name in references else float("nan")
        rows.append(
            {
                "kernel": name,
                "ms": 1e3 * sec,
                "iqr ms": 1e3 * iqr,
                "GB/s": bw,
                "fraction of copy bandwidth": bw / copy_bw,
                "torch reference ms": 1e3 * ref_sec,
                "speed-up over reference": ref_sec / sec,
            }
        )
    payload = {"args": vars(args), "device": device.type, "checks": checks, "rows": rows}
    stem = args.name or "sdp4bit_kernels" + ("_cpu" if backend == "numba" else "") + ("_quick" if args.quick else "")
    markdown, _ = render(payload)
    write_results(stem, payload, markdown)
    print(markdown)
    if not all(checks.values()):
        raise SystemExit(f"a {backend} kernel disagrees with the torch reference")


def render(payload: dict[str, Any]) -> tuple[str, None]:
    """The markdown page of a result (no plot)."""
    args, checks = payload["args"], payload["checks"]
    threads = f", {args['threads']} threads" if args["backend"] == "numba" else ""
    rows = [{**row, "target >= 0.5": _verdict(row)} for row in payload["rows"]]
    md = [
        f"# SDP4Bit fused kernels ({args['backend']} on {payload.get('device', 'cpu')}, {args['numel']} elements, "
        f"K={args['peers']}{threads})",
        "",
        "Equality with the torch reference: "
        + ", ".join(f"{c}: {'ok' if v else 'MISMATCH'}" for c, v in checks.items()),
        "",
        "Times are medians of `torch.utils.benchmark` (`iqr ms`: their interquartile range).",
        "",
        markdown_table(rows),
        "",
    ]
    if args["quick"]:
        md.insert(1, "\nSmoke run of the script: the timings mean nothing.\n")
    return "\n".join(md), None


def _verdict(row: dict[str, Any]) -> str:
    if row["kernel"].startswith("copy"):
        return "baseline"
    return "yes" if row["fraction of copy bandwidth"] >= 0.5 else "NO"


if __name__ == "__main__":
    main()
