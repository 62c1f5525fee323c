"""Zero gradients under TLq-HS: how far do the embedding rows of tokens absent from the data move?

A token that never occurs has an exactly zero gradient in its input-embedding row (untied GPT). Plain DDP leaves
such a row alone under Adam without weight decay (its moments stay 0). TLq-HS quantises after a 32-point Hadamard
transform; when a Hadamard block mixes zero and non-zero values, the inverse transform spreads the quantisation
noise of the non-zero values over the zeros, and Adam turns that noise into full-size steps. The strategy now
starts every parameter on a Hadamard block ("aligned"); rows that are whole blocks (``n_embd`` a multiple of 32)
then stay exactly zero, rows that straddle blocks (``n_embd=48``) still mix with present tokens' rows.

Configurations (all from the same initial weights and data, 2 gloo processes, Adam lr 1e-2, no weight decay):
``none/none`` (exact, what DDP does), ``qwd/tlq_hs`` with parameters packed end to end ("unaligned", the old layout)
and ``qwd/tlq_hs`` aligned (the default now). Writes ``benchmarks/results/sdp4bit_zero_blocks.{json,md,png}``.

Run from the repository root::

    .venv/bin/python -m benchmarks.sdp4bit_zero_blocks            # 60 steps
    .venv/bin/python -m benchmarks.sdp4bit_zero_blocks --quick    # 5 steps, n_embd 32: sdp4bit_zero_blocks_quick.*
"""

from __future__ import annotations

import argparse
import os
import traceback
from collections.abc import Sequence
from typing import Any

from benchmarks._common import free_port, markdown_table, write_results

VOCAB, BLOCK, WORLD = 96, 16, 2
CONFIGS = [("none/none", "none", "none", True), ("tlq_hs unaligned", "qwd", "tlq_hs", False),
           ("tlq_hs aligned", "qwd", "tlq_hs", True)]  # fmt: skip


def absent_ids() -> list[int]:
    """Every third token id never occurs (rare tokens are spread over the vocabulary, as in real tokenizers)."""
    return list(range(2, VOCAB, 3))


def _tokens(n: int, seed: int = 0) -> Any:
    """Zipf-distributed ids over the present tokens."""
    import torch

    present = torch.tensor(sorted(set(range(VOCAB)) - set(absent_ids())))
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, len(present) + 1, dtype=torch.float64)
    return present[torch.multinomial(p / p.sum(), n, replacement=True, generator=g)]


def _model(n_embd: int, steps: int) -> Any:
    import torch
    from torch import nn

    from lightning_sdp.models.gpt import GPT

    class UntiedGPT(GPT):
        """The project's GPT with a separate input embedding (tied, the output head would give every row a gradient)."""

        def _build(self, vocab_size: int) -> None:
            # a 3-value parameter that the loss does not use, first in the flat buffer: in the old layout it shifts
            # every later parameter off the Hadamard blocks
            self.unused = nn.Parameter(torch.zeros(1, 3))  # 2-D: in the same (decayed) param group as wte
            super()._build(vocab_size)
            self.transformer.wte = nn.Embedding(vocab_size, self.hparams.n_embd)
            nn.init.normal_(self.transformer.wte.weight, std=0.02)

    torch.manual_seed(0)
    return UntiedGPT(
        vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=n_embd, block_size=BLOCK, learning_rate=1e-2,
        weight_decay=0.0, warmup_steps=1, max_steps=steps,
    )  # fmt: skip


def _worker(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), NODE_RANK="0")  # fmt: skip
    try:
        import warnings

        import lightning.pytorch as pl
        import torch
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        from lightning_sdp.plugins.sdp4bit import SDP4BitStrategy

        torch.set_num_threads(1)
        ids = _tokens(args.steps * 4 * WORLD * (BLOCK + 1) + BLOCK + 1).view(-1, BLOCK + 1)
        data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        out = []
        for n_embd in args.n_embd:
            for label, weights, grads, aligned in CONFIGS:
                model = _model(n_embd, args.steps)
                init = model.transformer.wte.weight.detach().clone()
                strategy = SDP4BitStrategy(weights, grads, weight_group_size=256, seed=1)
                strategy._align_hadamard_blocks = aligned  # a measurement knob, not an option
                sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False)
                trainer = pl.Trainer(
                    strategy=strategy, devices=WORLD, accelerator="cpu", max_steps=args.steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False, limit_val_batches=0,
                )  # fmt: skip
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trainer.fit(model, DataLoader(data, batch_size=4, sampler=sampler))
                delta = (model.transformer.wte.weight.detach().float() - init).abs()
                mask = torch.zeros(VOCAB, dtype=torch.bool)
                mask[absent_ids()] = True
                absent, present = delta[mask], delta[~mask]
                out.append({
                    "n_embd": n_embd, "config": label,
                    "absent_rows_max_abs_change": float(absent.max()),
                    "absent_rows_mean_abs_change": float(absent.mean()),
                    "absent_rows_unchanged": int((absent.amax(dim=1) == 0).sum()),
                    "present_rows_mean_abs_change": float(present.mean()),
                    "final_train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
                })  # fmt: skip
        queue.put((rank, True, out))
    except BaseException:  # report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(WORLD):
        rank, ok, payload = queue.get()
        if not ok:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    for p in procs:
        p.join()
    return results[0]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n-embd", type=int, nargs="+", default=[32, 48])
    parser.add_argument("--quick", action="store_true", help="5 steps, n_embd 32 only; writes *_quick.*")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.n_embd = 5, [32]
    rows = run(args)
    table = markdown_table(rows)
    print(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['config']}\nn_embd={r['n_embd']}" for r in rows]
    ax.bar(range(len(rows)), [r["absent_rows_mean_abs_change"] for r in rows], color="tab:red", label="absent rows")
    ax.bar(range(len(rows)), [r["present_rows_mean_abs_change"] for r in rows], color="none", edgecolor="black",
           label="present rows")  # fmt: skip
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(f"mean |change| of wte rows after {args.steps} steps")
    ax.legend()
    markdown = (
        f"GPT (1 layer, untied input embedding, an unused 1x3 parameter first in its param group), vocabulary "
        f"{VOCAB} of which every third token ({len(absent_ids())} ids) never occurs (Zipf over the rest), 2 gloo "
        f"processes, Adam lr 1e-2 without weight decay, {args.steps} steps, batch 4 x {BLOCK} tokens per rank. Absent "
        "rows have an exactly zero gradient: DDP (none/none) leaves them unchanged.\n\n" + table
    )
    payload = {"steps": args.steps, "vocab": VOCAB, "absent_ids": absent_ids(), "rows": rows}
    write_results("sdp4bit_zero_blocks" + ("_quick" if args.quick else ""), payload, markdown, fig)


if __name__ == "__main__":
    main()
