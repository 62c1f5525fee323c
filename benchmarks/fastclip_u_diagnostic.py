"""Why FastCLIP's per-sample estimators u miss the full-data inner function g at small batches, measured.

Trains FastCLIP-v3 and SogCLR (``FastCLIPModule`` + ``GammaScheduler`` + ``TemperatureScheduler``, Lightning
``Trainer``, one process, one thread) on 10,240 generated ``scenes`` pairs, as ``benchmarks.fastclip_small_batch_10k``
does, with :class:`UDiagnosticProbe` attached. The probe follows a fixed sample of training anchors (both sides) and

* at every visit of an anchor (a training batch that contains it) records the estimator before (``u_old``) and after
  (``u_new``) the loss's update, and scores the anchor *exactly* against the whole training set with the parameters
  and temperature of that step (``g_then``, before the optimizer step, i.e. what the loss saw). ``u_new`` is the value
  whose inverse weights the anchor's gradient at that step, so ``|u_new - g_then| / g_then`` is the estimation error
  that matters; ``u_old`` against ``g_then`` is what the carried estimate brings in, and ``g_prev / g_then`` (``g_prev``
  the exact g at the anchor's previous visit) is how far g moved between two visits (staleness). The same moving
  average applied to ``g_batch / g_then`` (``g_batch`` the batch's own mini-batch g) is the ratio ``u / g`` would have
  if g had stood still (mini-batch sampling error alone); ``log(u_new / g_then)`` minus its log is the part that
  comes from g changing (``staleness_log_factor``);
* several times per epoch (``--probes-per-epoch``, default 4) scores all anchors exactly (``g_now``) and reports the
  total error of the stored u against ``g_now``, the error against ``g_then`` of the anchor's last update, the drift
  ``g_then / g_now``, the anchors' age in steps, the signed bias (median ``log(u / g)``, share of ``u > g``), the same
  for a fresh mini-batch estimate from ``B - 1`` random negatives, and the rare-terms statistics: the share of g
  carried by an anchor's top-1 and top-``(B - 1)`` negatives, the number of top negatives ``k50`` that carry half of
  g, and the probability that a random batch of ``B - 1`` negatives contains at least one of them.

The probe embeds the training set as training does (the training set's own transform; the runs use
``augment=False``, and the model has no dropout, so train and eval mode give the same embeddings) and checks it: from
the mini-batch g it recomputes with the batch's indices it predicts the loss's update ``(1 - gamma) u_old + gamma g``
and compares that with the ``u_new`` the loss stored (``probe_vs_training_u_rel_diff``, the largest relative
difference; at gamma = 1 this compares the two mini-batch g directly).

    .venv/bin/python -m benchmarks.fastclip_u_diagnostic            # 8 runs, 4 epochs (about 25 min, one core)
    .venv/bin/python -m benchmarks.fastclip_u_diagnostic --quick    # smoke run (< 1 min)
    .venv/bin/python -m benchmarks.fastclip_u_diagnostic --merge a.json b.json   # stored runs into one result

Writes ``benchmarks/results/fastclip_u_diagnostic.{json,md,png}`` (``..._quick`` with ``--quick``) and, after every
finished run, ``fastclip_u_diagnostic.partial.json``. ``--merge`` joins stored runs of the same settings (a later
file's run replaces an earlier one with the same label, after checking that they agree) into
``fastclip_u_diagnostic.*``, listing the files in the markdown; the committed result was made that way from the
8-run result and a rerun of three of its runs that added the "g stood still" columns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import Tensor

from benchmarks._common import RESULTS_DIR, markdown_table, write_results
from benchmarks.fastclip_small_batch import (
    add_training_args,
    bench_module,
    cached_datamodule,
    fit_and_score,
    run_quietly,
)
from lightning_sdp.integrations.open_clip import NANO_CONFIG

os.environ.setdefault("OMP_NUM_THREADS", "1")

DEFAULT_RUNS = (
    "fastclip_v3:16:0.2:0,sogclr:16:0.2:0,fastclip_v3:16:1.0:0,fastclip_v3:32:0.2:0,"
    "fastclip_v3:16:0.2:1,fastclip_v3:16:1.0:1,fastclip_v3:16:0.2:2,fastclip_v3:16:1.0:2"
)
"""``loss:global_batch:gamma_min:seed``; ``gamma_min = 1`` keeps gamma at 1 (u = the latest mini-batch estimate: no
carried, stale part), the controlled test of staleness, run with three seeds next to the default 0.2."""


def estimate_stats(estimate: Tensor, target: Tensor) -> dict[str, float]:
    """How an estimate of g compares with the exact g, over anchors.

    Args:
        estimate: ``(k,)`` estimates (u or a mini-batch mean), positive.
        target: ``(k,)`` exact values of g.

    Returns:
        ``rel_err`` (median ``|estimate - g| / g``), ``rel_err_p90``, ``log_ratio`` (median ``log(estimate / g)``:
        the signed bias, > 0 when the estimate is mostly too large) and ``above`` (share with ``estimate > g``).
    """
    if estimate.numel() == 0:
        return {"rel_err": math.nan, "rel_err_p90": math.nan, "log_ratio": math.nan, "above": math.nan}
    estimate, target = estimate.double(), target.double()
    rel = (estimate - target).abs() / target
    return {
        "rel_err": float(rel.median()),
        "rel_err_p90": float(rel.quantile(0.9)),
        "log_ratio": float(torch.log(estimate / target).median()),
        "above": float((estimate > target).double().mean()),
    }


def rare_term_stats(terms: Tensor, batch: int) -> dict[str, float]:
    """How much of each anchor's g sits in a few negatives, and how often a mini-batch sees them.

    Args:
        terms: ``(k, n)`` non-negative terms ``exp((a_i . o_j - a_i . o_i) / tau)`` of ``k`` anchors over the whole
            training set, with the anchor's own column set to 0 (so each row has ``n - 1`` negatives).
        batch: global batch size ``B``; a mini-batch holds ``B - 1`` negatives drawn without replacement.

    Returns:
        Medians over anchors of ``top1_share`` and ``topb_share`` (share of g in the largest 1 and ``B - 1`` terms),
        ``k50`` (fewest top terms that carry half of g) and ``p_batch_has_k50`` (probability that ``B - 1`` random
        negatives include at least one of those ``k50``: ``1 - C(n-1-k50, B-1) / C(n-1, B-1)``).
    """
    n_neg = terms.shape[1] - 1
    draws = min(batch - 1, n_neg)
    top = terms.double().sort(dim=1, descending=True).values[:, :n_neg]
    share = top.cumsum(dim=1) / top.sum(dim=1, keepdim=True)
    k50 = (share < 0.5).sum(dim=1) + 1
    # log C(m - k, d) - log C(m, d) = sum_{i < d} log((m - k - i) / (m - i)), zero once a batch must hit one
    i = torch.arange(draws, dtype=torch.float64)
    frac = ((n_neg - k50.double()[:, None] - i) / (n_neg - i)).clamp(min=0.0)
    p_hit = 1.0 - frac.prod(dim=1)
    return {
        "top1_share": float(share[:, 0].median()),
        "topb_share": float(share[:, draws - 1].median()),
        "k50": float(k50.double().median()),
        "p_batch_has_k50": float(p_hit.median()),
    }


class UDiagnosticProbe(Callback):
    """Follows fixed training anchors' estimators u against the exact full-data inner function g during training.

    Needs a module with ``gcl_loss`` (``u1``, ``u2``, ``gamma``), ``model.encode_image`` / ``encode_text`` and
    ``temperature`` (``FastCLIPModule``), batches ``(images, tokens, indices)`` and a datamodule with ``train_set``
    (``load_image``, ``transform``, ``tokens``). Results are in :attr:`visits` and :attr:`probes`.

    Args:
        anchors: dataset indices of the anchors to follow.
        batch_size: global batch size ``B`` (for the mini-batch estimate and the rare-terms statistics).
        probes_per_epoch: full probes per epoch, evenly spaced (the last one at the epoch's end). Default 4.
        exact_at_update: score visited anchors exactly at every visit (one pass over the training set per batch that
            holds an anchor). Without it ``g_then`` is unknown and only the ``g_now`` statistics are reported.
        minibatch_draws: random mini-batches per anchor for the fresh mini-batch estimate. Default 4.
        seed: seed of those draws.
    """

    def __init__(
        self,
        anchors: Tensor,
        batch_size: int,
        probes_per_epoch: int = 4,
        exact_at_update: bool = True,
        minibatch_draws: int = 4,
        seed: int = 12345,
    ) -> None:
        if probes_per_epoch < 1:
            raise ValueError(f"probes_per_epoch must be >= 1, got {probes_per_epoch}.")
        self.anchors = anchors.long()
        self.batch_size = int(batch_size)
        self.probes_per_epoch = int(probes_per_epoch)
        self.exact_at_update = exact_at_update
        self.minibatch_draws = int(minibatch_draws)
        self._gen = torch.Generator().manual_seed(seed)
        k = len(self.anchors)
        self._slot = {int(a): i for i, a in enumerate(self.anchors.tolist())}
        # per anchor and side (columns: image anchor, text anchor): step and exact g of the last and previous visit
        self.last_step = torch.full((k,), -1, dtype=torch.long)
        self.g_then = torch.full((k, 2), math.nan, dtype=torch.float64)
        # the same moving average applied to g_batch / g_then: what u / g would be if g never changed (no staleness)
        self.still_ratio = torch.full((k, 2), math.nan, dtype=torch.float64)
        self.visits: list[dict[str, float]] = []
        self.probes: list[dict[str, Any]] = []
        self._step = 0
        self._images: Tensor | None = None
        self._pending: dict[str, Tensor] | None = None

    @torch.no_grad()
    def _embed(self, trainer: Any, pl_module: Any) -> tuple[Tensor, Tensor]:
        """L2-normalised float64 embeddings of the whole training set with the current parameters."""
        ds = trainer.datamodule.train_set
        augment = bool(getattr(trainer.datamodule.hparams, "augment", False))
        images = self._images
        if images is None or augment:  # a random transform is redrawn at every probe, as training redraws it
            images = torch.stack([ds.transform(ds.load_image(i)) for i in range(len(ds))])
            self._images = None if augment else images
        was_training = pl_module.training
        pl_module.eval()  # no dropout in these towers: the same embeddings as in train mode (checked in the results)
        e1, e2 = [], []
        for start in range(0, len(ds), 1024):
            e1.append(F.normalize(pl_module.model.encode_image(images[start : start + 1024]), dim=-1))
            e2.append(F.normalize(pl_module.model.encode_text(ds.tokens[start : start + 1024]), dim=-1))
        pl_module.train(was_training)
        return torch.cat(e1).double(), torch.cat(e2).double()

    @staticmethod
    def _terms(e1: Tensor, e2: Tensor, anchors: Tensor, scale: float) -> list[Tensor]:
        """Per side, the ``(k, n)`` terms of g for ``anchors``, the anchor's own column zeroed."""
        out = []
        for a, o in ((e1, e2), (e2, e1)):
            pos = (a[anchors] * o[anchors]).sum(1, keepdim=True)
            terms = torch.exp((a[anchors] @ o.T - pos) * scale)
            terms[torch.arange(len(anchors)), anchors] = 0.0
            out.append(terms)
        return out

    @staticmethod
    def _u(pl_module: Any, idx: Tensor) -> Tensor:
        loss = pl_module.gcl_loss
        return torch.stack([loss.u1[idx], loss.u2[idx]], dim=1).double()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._pending = None
        if pl_module.gcl_loss is None:
            return
        idx = batch[2].long().cpu()
        hit = [(pos, self._slot[int(i)]) for pos, i in enumerate(idx.tolist()) if int(i) in self._slot]
        if not hit:
            return
        pos = torch.tensor([p for p, _ in hit])
        slots = torch.tensor([s for _, s in hit])
        pending = {"slots": slots, "u_old": self._u(pl_module, self.anchors[slots])}
        if self.exact_at_update:
            e1, e2 = self._embed(trainer, pl_module)
            n = e1.shape[0]
            terms = self._terms(e1, e2, self.anchors[slots], 1.0 / pl_module.temperature)
            pending["g_then"] = torch.stack([t.sum(1) / (n - 1) for t in terms], dim=1)
            # the mini-batch g the loss sees: the anchor's terms over the batch's other samples
            others = [idx[torch.arange(len(idx)) != p] for p in pos.tolist()]
            pending["g_batch"] = torch.stack(
                [torch.stack([t[r, o].mean() for r, o in enumerate(others)]) for t in terms], dim=1
            )
        self._pending = pending

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            self._record_visits(pl_module, self._pending)
            self._pending = None
        self._step += 1
        per_epoch = trainer.num_training_batches
        every = max(1, per_epoch // self.probes_per_epoch)
        if pl_module.gcl_loss is not None and ((batch_idx + 1) % every == 0 or batch_idx + 1 == per_epoch):
            if len(self.probes) and self.probes[-1]["step"] == self._step:
                return
            self._probe(trainer, pl_module, (batch_idx + 1) / per_epoch)

    def _record_visits(self, pl_module: Any, pending: dict[str, Tensor]) -> None:
        slots, u_old = pending["slots"], pending["u_old"]
        u_new = self._u(pl_module, self.anchors[slots])
        gamma = pl_module.gcl_loss.gamma
        u_pred = None
        if "g_batch" in pending:  # the loss's update from the probe's mini-batch g (u = g on a first visit)
            u_pred = torch.where(u_old > 0, (1.0 - gamma) * u_old + gamma * pending["g_batch"], pending["g_batch"])
        for r, slot in enumerate(slots.tolist()):
            for side in (0, 1):
                row = {
                    "step": self._step,
                    "epoch": pl_module.current_epoch,
                    "slot": slot,
                    "side": side,
                    "gamma": gamma,
                    "tau": pl_module.temperature,
                    "u_old": float(u_old[r, side]),
                    "u_new": float(u_new[r, side]),
                    "prev_step": int(self.last_step[slot]),
                    "g_prev": float(self.g_then[slot, side]),
                }
                if "g_then" in pending:
                    g_then, g_batch = float(pending["g_then"][r, side]), float(pending["g_batch"][r, side])
                    fresh = g_batch / g_then
                    old_ratio = float(self.still_ratio[slot, side])
                    still = (
                        fresh
                        if u_old[r, side] <= 0 or math.isnan(old_ratio)
                        else (1 - gamma) * old_ratio + gamma * fresh
                    )
                    self.still_ratio[slot, side] = still
                    row.update(g_then=g_then, g_batch=g_batch, still_ratio=still)
                if u_pred is not None:
                    row["u_pred"] = float(u_pred[r, side])
                self.visits.append(row)
            if "g_then" in pending:
                self.g_then[slot] = pending["g_then"][r]
            self.last_step[slot] = self._step

    @torch.no_grad()
    def _probe(self, trainer: Any, pl_module: Any, epoch_fraction: float) -> None:
        e1, e2 = self._embed(trainer, pl_module)
        n = e1.shape[0]
        terms = self._terms(e1, e2, self.anchors, 1.0 / pl_module.temperature)
        g_now = torch.stack([t.sum(1) / (n - 1) for t in terms], dim=1)
        u = self._u(pl_module, self.anchors)
        visited = (self.last_step >= 0)[:, None].expand(-1, 2) & (u > 0)
        known = visited & torch.isfinite(self.g_then)
        # fresh mini-batch estimate: B - 1 random negatives per anchor, several draws
        k = len(self.anchors)
        mb_est, mb_g = [], []
        for side in (0, 1):
            for _ in range(self.minibatch_draws):
                neg = torch.randint(0, n - 1, (k, self.batch_size - 1), generator=self._gen)
                neg = neg + (neg >= self.anchors[:, None]).long()  # skip the anchor itself
                mb_est.append(terms[side].gather(1, neg).mean(1))
                mb_g.append(g_now[:, side])
        age = (self._step - self.last_step[self.last_step >= 0]).double()
        row: dict[str, Any] = {
            "step": self._step,
            "epoch": pl_module.current_epoch + epoch_fraction,
            "tau": pl_module.temperature,
            "gamma": pl_module.gcl_loss.gamma,
            "visited": float(visited.double().mean()),
            "age_median": float(age.median()) if age.numel() else math.nan,
            "g_now_median": float(g_now.median()),
            "total": estimate_stats(u[visited], g_now[visited]),
            "proper": estimate_stats(u[known], self.g_then[known]),
            "drift_then_over_now": float((self.g_then[known] / g_now[known]).median()) if known.any() else math.nan,
            "minibatch": estimate_stats(torch.cat(mb_est), torch.cat(mb_g)),
            "rare": rare_term_stats(torch.cat(terms), self.batch_size),
        }
        self.probes.append(row)

    def visit_summary(self) -> list[dict[str, float]]:
        """Per epoch, over all visits: the error of ``u_new``, ``u_old`` and the mini-batch g against ``g_then``,
        the drift ``g_prev / g_then`` between two visits, and the probe-vs-training check."""
        rows = []
        for epoch in sorted({v["epoch"] for v in self.visits}):
            sel = [v for v in self.visits if v["epoch"] == epoch and "g_then" in v]
            if not sel:
                continue
            col = {key: torch.tensor([v[key] for v in sel], dtype=torch.float64) for key in sel[0]}
            again = col["u_old"] > 0
            prev_known = again & torch.isfinite(col["g_prev"])
            check = (col["u_pred"] - col["u_new"]).abs() / col["u_new"]
            rows.append(
                {
                    "epoch": epoch,
                    "visits": len(sel),
                    "revisits": int(again.sum()),
                    "gamma": float(col["gamma"].mean()),
                    "u_new_vs_g_then": estimate_stats(col["u_new"], col["g_then"]),
                    "minibatch_vs_g_then": estimate_stats(col["g_batch"], col["g_then"]),
                    "u_old_vs_g_then": estimate_stats(col["u_old"][again], col["g_then"][again]),
                    "u_old_vs_g_prev": estimate_stats(col["u_old"][prev_known], col["g_prev"][prev_known]),
                    "u_if_g_still": estimate_stats(col["still_ratio"], torch.ones_like(col["still_ratio"])),
                    "staleness_log_factor": float(
                        torch.log(col["u_new"] / (col["g_then"] * col["still_ratio"])).median()
                    ),
                    "drift_prev_over_then": float((col["g_prev"][prev_known] / col["g_then"][prev_known]).median())
                    if prev_known.any()
                    else math.nan,
                    "gap_steps_median": float((col["step"] - col["prev_step"])[prev_known].median())
                    if prev_known.any()
                    else math.nan,
                    "probe_vs_training_u_rel_diff": float(check.max()),
                }
            )
        return rows


def parse_runs(spec: str) -> list[tuple[str, int, float, int]]:
    """``"loss:batch:gamma_min[:seed],..."`` -> ``[(loss, batch, gamma_min, seed), ...]`` (seed default 0)."""
    out = []
    for item in spec.split(","):
        loss, batch, gamma_min, *seed = item.split(":")
        out.append((loss, int(batch), float(gamma_min), int(seed[0]) if seed else 0))
    return out


def train_one(loss: str, batch: int, gamma_min: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training run with the probe; zero-shot scores, the probes and the per-epoch visit summary."""
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler

    torch.set_num_threads(args.threads)
    dm = cached_datamodule(args, batch, seed, val_batch_size=500)
    pl.seed_everything(seed, verbose=False)
    steps = args.epochs * (dm.data_size // batch)
    module = bench_module(loss, steps, args)
    anchors = torch.randperm(dm.data_size, generator=torch.Generator().manual_seed(12345))[: args.probe_anchors]
    probe = UDiagnosticProbe(anchors, batch, probes_per_epoch=args.probes_per_epoch)
    decay_epochs = max(1, round(args.epochs * args.gamma_decay_fraction))
    gamma = GammaScheduler(gamma_min=gamma_min, decay_epochs=decay_epochs)
    scores = fit_and_score(module, dm, args.epochs, [gamma, TemperatureScheduler(), probe])
    return {
        "loss": loss,
        "batch": batch,
        "gamma_min": gamma_min,
        "label": f"{loss} B={batch} gamma_min={gamma_min:g} seed {seed}",
        "seed": seed,
        "steps": steps,
        **scores,
        "probes": probe.probes,
        "visit_summary": probe.visit_summary(),
    }


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for tables)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def render_markdown(payload: dict[str, Any]) -> str:
    """The result tables."""
    a = payload["args"]
    runs = payload["runs"]
    head = [
        f"`{a['dataset']}`, {a['num_train']} train / {a['num_val']} held-out pairs, {a['epochs']} epochs, seeds "
        "as listed (a single seed's zero-shot number is not a comparison: the seed spread at 10k pairs is 10-14 "
        f"points), model `NANO_CONFIG`, lr {a['lr']}, tau0 {a['temperature']}, v3: rho {a['rho']}, lr_tau "
        f"{a['lr_tau']}; GammaScheduler cosine from 1 to gamma_min over {a['gamma_decay_fraction']:.2g} of the "
        f"epochs (constant gamma_min after epoch 0 for SogCLR); {a['probe_anchors']} fixed anchors x 2 sides. "
        f"Wall time {payload['total_wall_s'] / 60:.1f} min.",
        "",
        markdown_table(
            [
                {
                    "run": r["label"],
                    "zeroshot_top1": 100 * r["zeroshot_top1"],
                    "retrieval_r1": 100 * r["retrieval_r1"],
                    "final_tau": r["final_tau"],
                    "wall_s": r["wall_s"],
                }
                for r in runs
            ],
            floatfmt="{:.3g}",
        ),
        "",
        "**At every visit** (medians over the anchors' visits in each epoch): `u_new` is the estimate whose inverse "
        "weights the anchor's gradient at that step, `g_then` the exact full-data g at that step; `minibatch` is the "
        "g of the batch's own B - 1 negatives (what gamma = 1 would use); `u_old` the carried estimate; `drift` = "
        "g at the previous visit / g_then; `u_if_g_still` = the same moving average applied to g_batch / g_then (the "
        "error u would have if g had not changed between visits: mini-batch sampling alone), and "
        "`staleness_log_factor` = median log(u_new / (g_then * u_if_g_still)), the part of log(u_new / g_then) that "
        "comes from g changing. `rel_err` = median |est - g| / g, `log_ratio` = median log(est / g).",
        "",
    ]
    visit_cols = [
        "run",
        "epoch",
        "gamma",
        "u_new_vs_g_then.rel_err",
        "u_new_vs_g_then.log_ratio",
        "u_new_vs_g_then.above",
        "minibatch_vs_g_then.rel_err",
        "minibatch_vs_g_then.log_ratio",
        "u_old_vs_g_then.rel_err",
        "u_old_vs_g_then.log_ratio",
        "u_old_vs_g_prev.log_ratio",
        "drift_prev_over_then",
        "u_if_g_still.rel_err",
        "u_if_g_still.log_ratio",
        "staleness_log_factor",
        "gap_steps_median",
        "probe_vs_training_u_rel_diff",
    ]
    visit_rows = [_flat({"run": r["label"], **v}) for r in runs for v in r["visit_summary"]]
    probe_cols = [
        "run",
        "epoch",
        "tau",
        "age_median",
        "total.rel_err",
        "total.log_ratio",
        "total.above",
        "proper.rel_err",
        "proper.log_ratio",
        "drift_then_over_now",
        "minibatch.rel_err",
        "minibatch.log_ratio",
        "rare.top1_share",
        "rare.topb_share",
        "rare.k50",
        "rare.p_batch_has_k50",
    ]
    probe_rows = [_flat({"run": r["label"], **p}) for r in runs for p in r["probes"]]
    return "\n".join(
        [
            *head,
            markdown_table(visit_rows, visit_cols, floatfmt="{:.3g}"),
            "",
            f"**At the probes** ({a['probes_per_epoch']} per epoch, all anchors): `total` = stored u vs g now, "
            "`proper` = stored u vs g at its last update (g_then), `drift_then_over_now` = median g_then / g_now, "
            "`age` = optimizer steps since the last update (1 right after it); `minibatch` = a fresh estimate from "
            "B - 1 random negatives vs g now; `rare`: share of g in the top-1 and top-(B - 1) negatives, k50 = top "
            "negatives carrying half of g, and the probability that B - 1 random negatives contain one of them.",
            "",
            markdown_table(probe_rows, probe_cols, floatfmt="{:.3g}"),
        ]
    )


def _figure(runs: list[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in runs:
        visits = [v for v in r["visit_summary"] if v["epoch"] > 0]
        ve = [v["epoch"] for v in visits]
        line = axes[0].plot(ve, [v["u_new_vs_g_then"]["log_ratio"] for v in visits], marker="o", label=r["label"])
        c = line[0].get_color()
        axes[0].plot(ve, [math.log(v["drift_prev_over_then"]) for v in visits], ls="--", color=c)
        axes[0].plot(ve, [v["minibatch_vs_g_then"]["log_ratio"] for v in visits], ls=":", color=c)
        ep = [p["epoch"] for p in r["probes"]]
        axes[1].plot(ep, [p["total"]["rel_err"] for p in r["probes"]], marker=".", color=c)
        axes[1].plot(ep, [p["proper"]["rel_err"] for p in r["probes"]], ls="--", color=c)
        axes[2].plot(ep, [p["rare"]["topb_share"] for p in r["probes"]], marker=".", color=c)
        axes[2].plot(ep, [p["rare"]["p_batch_has_k50"] for p in r["probes"]], ls="--", color=c)
    axes[0].set_title(
        "at each visit, medians: log(u_new / g_then) (solid), log(g_prev / g_then) = drift since the previous "
        "visit (dashed), log(batch's own g / g_then) (dotted)"
    )
    axes[0].axhline(0, color="k", lw=0.5)
    axes[1].set_title("probes: median |u - g| / g against g now (solid) and against g at u's last update (dashed)")
    axes[1].set_yscale("log")
    axes[2].set_title(
        "probes: share of g in the top B-1 negatives (solid), P(B-1 random negatives hold one of top-k50)"
    )
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(7)
        ax.title.set_wrap(True)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return fig


MERGE_SETTINGS = ("dataset", "num_train", "num_val", "data_seed", "epochs", "lr", "temperature", "lr_tau", "rho")
"""Arguments that stored runs must share to be merged."""


def merge_payloads(stored: list[tuple[str, dict[str, Any]]], name: str) -> dict[str, Any]:
    """Join the runs of stored results into one payload, numbers unchanged.

    Args:
        stored: ``(file name, payload)`` in order; a later payload's run replaces an earlier run with the same label
            (in its place), a new label is appended.
        name: the merged result's name (``args.name``).

    Raises:
        ValueError: payloads with different :data:`MERGE_SETTINGS`, or a replacing run whose scores differ from the
            run it replaces (then they are not the same run).
    """
    first = stored[0][1]
    runs = list(first["runs"])
    for source, payload in stored[1:]:
        differ = [k for k in MERGE_SETTINGS if payload["args"].get(k) != first["args"].get(k)]
        if differ:
            raise ValueError(f"{source} was run with other settings ({', '.join(differ)}); only like runs merge.")
        for run in payload["runs"]:
            at = next((i for i, r in enumerate(runs) if r["label"] == run["label"]), None)
            if at is None:
                runs.append(run)
                continue
            scores = ("zeroshot_top1", "retrieval_r1", "final_tau", "steps")
            if any(runs[at][k] != run[k] for k in scores):
                raise ValueError(f"{source}: run {run['label']!r} has other scores than the run it would replace.")
            runs[at] = run
    merged = {key: value for key, value in first.items() if key not in ("runs", "merged_from")}
    merged["args"] = {**first["args"], "name": name, "runs": ",".join(r["label"] for r in runs)}
    merged.update(
        runs=runs,
        planned_runs=len(runs),
        complete=all(p.get("complete", True) for _, p in stored),
        total_wall_s=sum(p["total_wall_s"] for _, p in stored),
        merged_from=[
            {"file": source, "runs": [r["label"] for r in p["runs"]], "machine": p.get("machine")}
            for source, p in stored
        ],
    )
    return merged


def _merged_markdown(payload: dict[str, Any]) -> str:
    lines = ["", "Merged from (a later file's run replaces the same run of an earlier one):", ""]
    for part in payload.get("merged_from", []):
        date = (part.get("machine") or {}).get("date", "?")
        lines.append(f"- `{part['file']}` ({date}): {'; '.join(part['runs'])}")
    return "\n".join(lines)


def _payload(args: argparse.Namespace, runs: list[dict[str, Any]], planned: int, t_start: float) -> dict[str, Any]:
    return {
        "args": vars(args),
        "runs": runs,
        "bench_model": NANO_CONFIG,
        "planned_runs": planned,
        "complete": len(runs) == planned,
        "total_wall_s": time.perf_counter() - t_start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: fastclip_v3, 256 pairs, batch 16, 2 epochs")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated loss:global_batch:gamma_min:seed")
    parser.add_argument("--epochs", type=int, default=4)
    add_training_args(parser, "scenes", ["shapes", "scenes"], num_train=10_240, num_val=1_000)
    parser.add_argument("--gamma-decay-fraction", type=float, default=0.5)
    parser.add_argument("--probe-anchors", type=int, default=128)
    parser.add_argument("--probes-per-epoch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="fastclip_u_diagnostic")
    parser.add_argument("--from-json", default=None, help="re-render the tables and plot of a (partial) run's JSON")
    parser.add_argument("--merge", nargs="+", default=None, help="stored results to join into --name's files")
    args = parser.parse_args()
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        write_results(payload["args"]["name"], payload, render_markdown(payload), _figure(payload["runs"]))
        return
    if args.merge:
        stored = [(Path(f).name, json.loads(Path(f).read_text())) for f in args.merge]
        payload = merge_payloads(stored, args.name)
        md = render_markdown(payload) + _merged_markdown(payload)
        write_results(args.name, payload, md, _figure(payload["runs"]))
        return
    if args.quick:
        args.runs, args.epochs, args.num_train, args.num_val = "fastclip_v3:16:0.2:0", 2, 256, 48
        args.probe_anchors, args.name = 32, args.name + "_quick"
    jobs = parse_runs(args.runs)
    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    partial = RESULTS_DIR / f"{args.name}.partial.json"
    for loss, batch, gamma_min, seed in jobs:  # one run at a time, in this process
        r = run_quietly(train_one, (loss, batch, gamma_min, seed, args))
        runs.append(r)
        last = r["visit_summary"][-1] if r["visit_summary"] else {}
        print(
            f"{r['label']:36s} top1 {100 * r['zeroshot_top1']:5.1f} R@1 {100 * r['retrieval_r1']:5.1f} "
            f"u_new err {last.get('u_new_vs_g_then', {}).get('rel_err', math.nan):.3f} "
            f"({r['wall_s']:.0f}s, total {time.perf_counter() - t_start:.0f}s)",
            flush=True,
        )
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(_payload(args, runs, len(jobs), t_start), indent=1) + "\n")
    payload = _payload(args, runs, len(jobs), t_start)
    write_results(args.name, payload, render_markdown(payload), _figure(runs))


if __name__ == "__main__":
    main()
