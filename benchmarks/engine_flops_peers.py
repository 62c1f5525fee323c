"""EngineProfiler FLOPs against the peers: fvcore, ptflops (both backends) and DeepSpeed's flops profiler.

One table of the FLOPs (or MACs) each counter gives for the same models and inputs:

- the GPT of :mod:`lightning_sdp.models.gpt` at several sequence lengths, with explicit
  (``softmax(QK^T)V`` as matmuls) and fused (``scaled_dot_product_attention``) attention;
- torchvision's resnet18;
- open_clip vision towers: the bundled ``fastclip-tiny`` ViT and, in the full run, ``ViT-S-16``.

EngineProfiler's counter is :class:`lightning_sdp.profiling.flops.WorkCounter` (what the callback runs in its
last warm-up batch); it runs on the forward pass (what the peers count) and on forward + backward (what the
callback reports per training step). Every model is counted in ``eval()`` mode with autograd on, because
ptflops and DeepSpeed switch the model to ``eval()`` themselves. Each difference is split into its parts in
the same run (MACs vs FLOPs, fused attention, bias adds, elementwise operators), so the table explains
itself; the callback is also run once in a Trainer to show that it reports the counter's number.

    .venv/bin/python -m benchmarks.engine_flops_peers            # full (about a minute on 2 shared cores)
    .venv/bin/python -m benchmarks.engine_flops_peers --quick    # smoke run (well under a minute)

Needs the ``bench`` peers (``fvcore``, ``ptflops``, ``deepspeed``) and the ``clip`` extra (open_clip,
torchvision); a peer that is missing or fails is recorded with its reason in the results, never left out.
Writes ``benchmarks/results/engine_flops_peers.{json,md,png}`` (``engine_flops_peers_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._common import machine_info, markdown_table, write_results
from lightning_sdp.profiling.flops import WorkCount, WorkCounter

VOCAB = 65

# fvcore operator handles that are matrix products (the rest are norms, pooling, upsampling: elementwise work).
_FVCORE_MATRIX = {"addmm", "linear", "matmul", "bmm", "mm", "einsum", "conv", "baddbmm", "_convolution"}


@dataclass
class ModelCase:
    """One row of the table: a model, its forward inputs and whether the 1% target applies."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    make_input: Callable[[], Tensor]
    target: bool
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def _gpt_case(seq_len: int, attention: str, args: argparse.Namespace) -> ModelCase:
    from lightning_sdp.models.gpt import GPT

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(
            vocab_size=VOCAB,
            n_layer=args.gpt_layers,
            n_head=args.gpt_heads,
            n_embd=args.gpt_width,
            block_size=seq_len,
            attention=attention,  # type: ignore[arg-type]
        )

    def make_input() -> Tensor:
        return torch.randint(0, VOCAB, (args.batch_size, seq_len), generator=torch.Generator().manual_seed(0))

    return ModelCase(
        name=f"GPT {attention} T={seq_len}",
        family="gpt",
        build=build,
        make_input=make_input,
        # Explicit attention is matrix products only; the fused SDPA kernel is counted by EngineProfiler and by
        # DeepSpeed but not by fvcore or ptflops, so the MACs x 2 target is about the explicit variant.
        target=attention == "explicit",
        details={"seq_len": seq_len, "attention": attention},
    )


def _resnet_case(image_size: int, args: argparse.Namespace) -> ModelCase:
    def build() -> nn.Module:
        import torchvision

        torch.manual_seed(0)
        return torchvision.models.resnet18()

    def make_input() -> Tensor:
        return torch.randn(args.batch_size, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))

    return ModelCase(
        f"resnet18 {image_size}px", "resnet18", build, make_input, True, details={"image_size": image_size}
    )


def _vit_case(model_name: str, args: argparse.Namespace) -> ModelCase:
    from lightning_sdp.integrations.open_clip import build_clip, image_size_of

    size = image_size_of("tiny" if model_name == "fastclip-tiny" else model_name)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return build_clip("tiny" if model_name == "fastclip-tiny" else model_name).visual

    def make_input() -> Tensor:
        return torch.randn(args.batch_size, 3, size, size, generator=torch.Generator().manual_seed(0))

    # open_clip's blocks use nn.MultiheadAttention, which runs the fused SDPA kernel: not a linear/conv-only model.
    return ModelCase(
        f"open_clip {model_name} (vision) {size}px",
        "vit",
        build,
        make_input,
        False,
        details={"image_size": size},
    )


# ---------------------------------------------------------------------------------------------------- counters


def _ep_forward(case: ModelCase) -> dict[str, Any]:
    model = case.build().eval()
    x = case.make_input()
    with WorkCounter() as wc:
        model(x)
    return _ep_dict(wc.count)


def _ep_forward_backward(case: ModelCase) -> dict[str, Any]:
    model = case.build().eval()
    x = case.make_input()
    with WorkCounter() as wc:
        out = model(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().sum().backward()
    return _ep_dict(wc.count)


def _ep_dict(count: WorkCount) -> dict[str, Any]:
    return {
        "flops": int(count.total_flops),
        "matrix_flops": int(count.matrix_flops),
        "attention_flops": int(count.attention_flops),
        "vector_elements": int(count.elements.get("vector", 0)),
    }


def _fvcore(case: ModelCase) -> dict[str, Any]:
    from fvcore.nn import FlopCountAnalysis

    model = case.build().eval()
    x = case.make_input()
    fca = FlopCountAnalysis(model, (x,))
    fca.unsupported_ops_warnings(False)
    fca.uncalled_modules_warnings(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit tracer warnings
        total = int(fca.total())
        by_op = {k: int(v) for k, v in fca.by_operator().items()}
        skipped = {str(k): int(v) for k, v in fca.unsupported_ops().items()}
    matrix = sum(v for k, v in by_op.items() if k in _FVCORE_MATRIX)
    return {
        "macs": total,
        "matrix_macs": matrix,
        "other_macs": total - matrix,
        "by_operator": by_op,
        "skipped_ops": {k: v for k, v in skipped.items() if "attention" in k or "softmax" in k or "gelu" in k},
    }


def _ptflops(case: ModelCase, backend: str) -> dict[str, Any]:
    from ptflops import get_model_complexity_info

    model = case.build().eval()
    x = case.make_input()
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        macs, _ = get_model_complexity_info(
            model,
            tuple(x.shape[1:]),
            input_constructor=lambda _res: x,
            as_strings=False,
            print_per_layer_stat=False,
            backend=backend,
            ost=sink,
        )
    if macs is None:
        raise RuntimeError(f"ptflops ({backend}) failed: {sink.getvalue()[-400:]}")
    return {"macs": int(macs)}


def _deepspeed(case: ModelCase) -> dict[str, Any]:
    from deepspeed.profiling.flops_profiler import get_model_profile

    model = case.build().eval()
    x = case.make_input()
    flops, macs, _ = get_model_profile(model, args=[x], print_profile=False, detailed=False, warm_up=0, as_string=False)
    return {"flops": int(flops), "macs": int(macs)}


def _safe(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run one counter; a failure is recorded with its reason (never dropped)."""
    t0 = time.perf_counter()
    try:
        out = fn(*args)
    except ImportError as err:
        return {"error": f"not installed: {err}"}
    except Exception as err:  # record why a peer failed on this model
        return {
            "error": f"{type(err).__name__}: {str(err)[:300]}",
            "traceback": traceback.format_exc()[-1500:],
        }
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _peer_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for name in ("fvcore", "ptflops", "deepspeed", "torchvision", "open_clip_torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def count_case(case: ModelCase) -> dict[str, Any]:
    """All counters on one model case."""
    row: dict[str, Any] = {"model": case.name, "family": case.family, "target": case.target, **case.details}
    row["ep_fwd"] = _safe(_ep_forward, case)
    row["ep_fwd_bwd"] = _safe(_ep_forward_backward, case)
    row["fvcore"] = _safe(_fvcore, case)
    row["ptflops_pytorch"] = _safe(_ptflops, case, "pytorch")
    row["ptflops_aten"] = _safe(_ptflops, case, "aten")
    row["deepspeed"] = _safe(_deepspeed, case)
    _explain(row)
    return row


def _get(row: dict[str, Any], counter: str, key: str) -> int | None:
    value = row.get(counter, {}).get(key)
    return None if value is None else int(value)


def _explain(row: dict[str, Any]) -> None:
    """Ratios against EngineProfiler and the residual of each difference once its known parts are removed."""
    ep = _get(row, "ep_fwd", "flops")
    ep_mat = _get(row, "ep_fwd", "matrix_flops")
    ep_att = _get(row, "ep_fwd", "attention_flops") or 0
    fwd_bwd = _get(row, "ep_fwd_bwd", "flops")
    ratios: dict[str, float | None] = {}
    resid: dict[str, int | None] = {}
    if ep:
        fv_mat = _get(row, "fvcore", "matrix_macs")
        fv_all = _get(row, "fvcore", "macs")
        pt_aten = _get(row, "ptflops_aten", "macs")
        pt_py = _get(row, "ptflops_pytorch", "macs")
        ds_fl = _get(row, "deepspeed", "flops")
        ds_mac = _get(row, "deepspeed", "macs")
        ratios["ep_over_2x_fvcore_matrix"] = ep / (2 * fv_mat) if fv_mat else None
        ratios["ep_over_2x_fvcore_total"] = ep / (2 * fv_all) if fv_all else None
        ratios["ep_over_2x_ptflops_aten"] = ep / (2 * pt_aten) if pt_aten else None
        ratios["ep_over_2x_ptflops_pytorch"] = ep / (2 * pt_py) if pt_py else None
        ratios["ep_over_deepspeed_flops"] = ep / ds_fl if ds_fl else None
        ratios["ep_over_2x_deepspeed_macs"] = ep / (2 * ds_mac) if ds_mac else None
        ratios["fwd_bwd_over_fwd"] = fwd_bwd / ep if fwd_bwd else None
        # fvcore: matrix MACs x 2 are EngineProfiler's matrix FLOPs; the fused SDPA kernel is not counted.
        resid["fvcore_matrix"] = None if fv_mat is None else ep_mat - 2 * fv_mat
        # ptflops aten: mm/addmm/bmm/conv MACs, with one add per output element for addmm's bias.
        resid["ptflops_aten"] = None if pt_aten is None else ep_mat - 2 * pt_aten
        # DeepSpeed: MACs x 2 of linear, matmul, conv and SDPA; its FLOPs add elementwise operators on top.
        resid["deepspeed_2x_macs"] = None if ds_mac is None else ep - 2 * ds_mac
        resid["deepspeed_elementwise_flops"] = None if ds_fl is None or ds_mac is None else ds_fl - 2 * ds_mac
        resid["fused_attention_flops"] = ep_att
    row["ratios"] = ratios
    row["residuals"] = resid


def callback_check(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Run the callback itself on the smallest GPT and compare its per-step FLOPs with the counter's fwd + bwd."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sdp.callbacks.engine_profiler import EngineProfiler

    seq = min(args.seq_lens)
    case = _gpt_case(seq, "sdpa", args)
    model = case.build()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4 * args.batch_size, seq + 1), generator=g)
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=args.batch_size)
    cb = EngineProfiler(
        wait=0, warmup=1, active=1, repeat=1, dirpath=str(tmp / "cb"), export_trace=False, save_plot=False,
        print_summary=False, log_metrics=False,
    )  # fmt: skip
    Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    ).fit(model, loader)
    fl = cb.reports[0].flops if cb.reports else None
    step = fl.total_flops if fl is not None else None
    # The same training step under the counter alone (train mode, cross-entropy loss; AdamW adds no matrix work).
    model = case.build().train()
    xb, yb = x[: args.batch_size, :-1], x[: args.batch_size, 1:]
    with WorkCounter() as wc:
        model.loss((xb, yb)).backward()
    return {
        "model": case.name,
        "callback_flops_per_step": step,
        "counter_fwd_bwd_flops": int(wc.count.total_flops),
        "equal": step == int(wc.count.total_flops),
    }


# ---------------------------------------------------------------------------------------------------- report


def _g(v: int | None, scale: float = 1e9) -> Any:
    return "—" if v is None else round(v / scale, 4)


def _r(v: float | None) -> Any:
    return "—" if v is None else f"{v:.4f}"


def _cell(row: dict[str, Any], counter: str, key: str) -> Any:
    entry = row.get(counter, {})
    if "error" in entry:
        return "failed" if "not installed" not in entry["error"] else "not installed"
    return _g(_get(row, counter, key))


def tables(rows: list[dict[str, Any]]) -> tuple[str, str, str]:
    counts, ratios, resid = [], [], []
    for r in rows:
        counts.append(
            {
                "model": r["model"],
                "EP fwd GFLOP": _cell(r, "ep_fwd", "flops"),
                "EP fwd+bwd GFLOP": _cell(r, "ep_fwd_bwd", "flops"),
                "fvcore GMAC": _cell(r, "fvcore", "macs"),
                "fvcore matrix GMAC": _cell(r, "fvcore", "matrix_macs"),
                "ptflops (pytorch) GMAC": _cell(r, "ptflops_pytorch", "macs"),
                "ptflops (aten) GMAC": _cell(r, "ptflops_aten", "macs"),
                "DeepSpeed GFLOP": _cell(r, "deepspeed", "flops"),
                "DeepSpeed GMAC": _cell(r, "deepspeed", "macs"),
            }
        )
        q = r.get("ratios", {})
        target = q.get("ep_over_2x_fvcore_total")
        ratios.append(
            {
                "model": r["model"],
                "EP / 2×fvcore matrix": _r(q.get("ep_over_2x_fvcore_matrix")),
                "EP / 2×fvcore all": _r(q.get("ep_over_2x_fvcore_total")),
                "EP / 2×ptflops aten": _r(q.get("ep_over_2x_ptflops_aten")),
                "EP / 2×ptflops pytorch": _r(q.get("ep_over_2x_ptflops_pytorch")),
                "EP / 2×DeepSpeed MAC": _r(q.get("ep_over_2x_deepspeed_macs")),
                "EP / DeepSpeed FLOP": _r(q.get("ep_over_deepspeed_flops")),
                "fwd+bwd / fwd": _r(q.get("fwd_bwd_over_fwd")),
                "1% target": (
                    "n/a (fused attention)"
                    if not r["target"]
                    else ("—" if target is None else ("met" if abs(target - 1) <= 0.01 else "MISSED"))
                ),
            }
        )
        s = r.get("residuals", {})
        resid.append(
            {
                "model": r["model"],
                "EP fused-attention MFLOP": _g(s.get("fused_attention_flops"), 1e6),
                "EP matrix − 2×fvcore matrix (MFLOP)": _g(s.get("fvcore_matrix"), 1e6),
                "EP matrix − 2×ptflops aten (MFLOP)": _g(s.get("ptflops_aten"), 1e6),
                "EP − 2×DeepSpeed MAC (MFLOP)": _g(s.get("deepspeed_2x_macs"), 1e6),
                "DeepSpeed FLOP − 2×MAC (MFLOP)": _g(s.get("deepspeed_elementwise_flops"), 1e6),
                "fvcore non-matrix MMAC": _g(_get(r, "fvcore", "other_macs"), 1e6),
                "EP vector Melements (not FLOPs)": _g(_get(r, "ep_fwd", "vector_elements"), 1e6),
            }
        )
    return markdown_table(counts), markdown_table(ratios), markdown_table(resid)


EXPLANATION = """\
## Why the counters differ

- **MACs vs FLOPs.** fvcore and ptflops count multiply-accumulates (one per `a*b+c`); EngineProfiler
  (`torch.utils.flop_counter`) and DeepSpeed's FLOPs count 2 per MAC. So the fair comparison is EngineProfiler
  against 2×MACs: on linear/conv models (resnet18, the GPT with explicit attention) EngineProfiler's forward
  FLOPs equal fvcore's matrix MACs × 2 exactly (`EP / 2×fvcore matrix` = 1.0000; the residual column is 0),
  and fvcore's total MACs × 2 within 1% (the rest is fvcore's norms and pooling, next point but one).
- **Forward only vs forward + backward.** Every peer counts one forward pass. EngineProfiler's callback counts
  the whole training step: forward + backward, about 3× the forward (the backward of a matmul is two matmuls
  of the same size). It is less than 3× where an input needs no gradient: resnet18's first convolution (the
  image needs no gradient), the ViT's patch embedding, and the GPT's embedding lookups (no matrix work at
  all). It is more than 3× with the fused attention kernel: its backward recomputes the scores `QK^T` (the
  flash-attention algorithm keeps no T×T matrix), so it counts 5 attention matmuls backward for 2 forward
  (2.5×), as `FlopCounterMode` does.
- **Attention counted or not.** With the fused kernel (`scaled_dot_product_attention`, also what
  `nn.MultiheadAttention` runs in open_clip), EngineProfiler counts `QK^T` and `AV` under `attention_fused`
  over the scores the mask keeps: 4·B·H·T²·d forward without a mask, (T+1)/(2T) of it for the GPT's causal
  attention, which the fused kernel skips block by block. `FlopCounterMode` and DeepSpeed count the full square,
  so for the fused GPT `EP − 2×DeepSpeed MAC` is minus the masked half. fvcore does not know
  `aten::scaled_dot_product_attention` (it lists it as unsupported and skips it) and ptflops' aten backend
  does not map the CPU flash-attention operator, so both miss exactly `EP fused-attention` FLOPs: the gap
  grows as T² and dominates the long-sequence rows. ptflops' pytorch backend has a hook for
  `nn.MultiheadAttention` that counts the attention products (so it sits closer on the ViT) but does not patch
  `F.scaled_dot_product_attention`, so the GPT's fused attention is missing there too. With explicit attention
  every counter sees the two matmuls (ptflops' pytorch backend only where they are called as `torch.matmul`,
  not via the `@` operator, which it does not patch).
- **Elementwise operators.** EngineProfiler keeps them out of FLOPs on purpose: they are vector-engine work,
  reported separately as elements and bytes (`vector_elements` in the JSON). fvcore adds norms and pooling
  (`fvcore non-matrix` column: batch-norm, layer-norm, adaptive pooling), ptflops' pytorch backend adds norms,
  activations, pooling, softmax and bias adds, DeepSpeed's FLOPs add activations, norms, softmax, pooling and
  `torch.add`/`torch.mul` (`DeepSpeed FLOP − 2×MAC`), and its MACs leave out biases.
- **Bias adds.** ptflops counts bias adds as MACs (the aten backend one per output element of `addmm`, the
  pytorch backend per output feature of `nn.Linear`); fvcore, DeepSpeed's MACs and EngineProfiler count only
  the products. That is the small negative residual in `EP matrix − 2×ptflops aten` (resnet18: its one biased
  layer, the 1000-way classifier).
"""


def plot(rows: list[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("2×fvcore MAC", lambda r: 2 * (_get(r, "fvcore", "macs") or 0)),
        ("2×ptflops pytorch MAC", lambda r: 2 * (_get(r, "ptflops_pytorch", "macs") or 0)),
        ("2×ptflops aten MAC", lambda r: 2 * (_get(r, "ptflops_aten", "macs") or 0)),
        ("DeepSpeed FLOP", lambda r: _get(r, "deepspeed", "flops") or 0),
        ("EP fwd+bwd FLOP", lambda r: _get(r, "ep_fwd_bwd", "flops") or 0),
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.5))
    width = 0.8 / len(series)
    for i, (label, fn) in enumerate(series):
        vals = [fn(r) / max(1, _get(r, "ep_fwd", "flops") or 1) for r in rows]
        ax.bar([j + (i - len(series) / 2 + 0.5) * width for j in range(len(rows))], vals, width, label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["model"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("count / EngineProfiler forward FLOPs")
    ax.set_title("FLOPs against the peers (1.0 = EngineProfiler forward)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small inputs, fewer models (well under a minute)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--gpt-layers", type=int, default=2)
    p.add_argument("--gpt-width", type=int, default=128)
    p.add_argument("--gpt-heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--image-size", type=int, default=224, help="resnet18 input size")
    p.add_argument("--vits", nargs="+", default=["fastclip-tiny", "ViT-S-16"], help="open_clip model names")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.image_size, args.vits = [64, 256], 64, ["fastclip-tiny"]
    torch.set_num_threads(args.threads)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    name = "engine_flops_peers" + ("_quick" if args.quick else "")
    load_before = machine_info().get("load_avg_1m")
    t0 = time.perf_counter()

    cases = [_gpt_case(t, a, args) for t in args.seq_lens for a in ("explicit", "sdpa")]
    cases.append(_resnet_case(args.image_size, args))
    cases += [_vit_case(v, args) for v in args.vits]
    rows = []
    for case in cases:
        row = count_case(case)
        rows.append(row)
        errors = {k: v["error"] for k, v in row.items() if isinstance(v, dict) and "error" in v}
        print(f"{case.name}: EP fwd {row['ep_fwd'].get('flops')} ratios {row['ratios']} errors {errors}")
    tmp = Path(tempfile.mkdtemp(prefix="engine_flops_peers_"))
    check = callback_check(args, tmp)
    print(f"callback check: {check}")
    wall = time.perf_counter() - t0

    counts_md, ratios_md, resid_md = tables(rows)
    failures = [
        f"- {r['model']}: {k}: {v['error']}" for r in rows for k, v in r.items() if isinstance(v, dict) and "error" in v
    ]
    targets = [r for r in rows if r["target"]]
    met = [r for r in targets if abs((r["ratios"].get("ep_over_2x_fvcore_total") or 0) - 1) <= 0.01]
    versions = _peer_versions()
    md = (
        f"Forward pass, batch {args.batch_size}, fp32, `eval()` mode, CPU ({args.threads} threads). GPT: "
        f"{args.gpt_layers} layers, width {args.gpt_width}, {args.gpt_heads} heads, vocabulary {VOCAB}. "
        f"EP = EngineProfiler's counter (`WorkCounter`, FLOPs = 2 per multiply-add). Peers: "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f".\n\nTarget (EP forward FLOPs = fvcore MACs × 2 within 1% on linear/conv models, i.e. resnet18 and "
        f"the GPT with explicit attention; judged on fvcore's total, norms and pooling included): "
        f"{len(met)}/{len(targets)} met.\n\n## Counts\n\n{counts_md}\n\n## Ratios\n\n{ratios_md}\n\n"
        f"## Differences split into their parts\n\n{resid_md}\n\n{EXPLANATION}\n"
        f"## The callback reports the counter's forward + backward\n\n"
        f"`EngineProfiler(wait=0, warmup=1, active=1)` in a Trainer on {check['model']} (batch "
        f"{args.batch_size}): {check['callback_flops_per_step']} FLOPs per step; the counter on one training step "
        f"(cross-entropy loss, backward): {check['counter_fwd_bwd_flops']} — "
        + ("equal." if check["equal"] else "NOT equal.")
        + "\n\n"
        + ("## Counter failures\n\n" + "\n".join(failures) + "\n\n" if failures else "")
        + f"Whole benchmark {wall:.0f} s. 1-minute load average before: {load_before}."
    )
    payload = {
        "config": vars(args),
        "peer_versions": versions,
        "rows": rows,
        "callback_check": check,
        "targets_met": f"{len(met)}/{len(targets)}",
        "wall_s": wall,
        "load_avg_before": load_before,
    }
    write_results(name, payload, md, plot(rows))
    print(md)


if __name__ == "__main__":
    main()
