"""What the FastCLIP benchmarks share: cached data, the benchmark module, training and scoring runs in worker
processes, the estimators' diagnostic probes and the small-batch study's tables."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import Tensor

from lightning_sdp.integrations.open_clip import NANO_CONFIG

_DATA: dict[Any, Any] = {}


def cached_datamodule(args: argparse.Namespace, batch: int, seed: int, val_batch_size: int = 256) -> Any:
    """One generated data set per worker process (generation and tokenisation are not what we measure).

    Args:
        args: the benchmark's arguments (``dataset``, ``num_train``, ``num_val``, ``data_seed``).
        batch: training batch size of this run.
        seed: seed of this run's training order.
        val_batch_size: validation batch size.
    """
    from lightning_sdp.datamodules import ImageTextDataModule

    key = (args.dataset, args.num_train, args.num_val, args.data_seed)
    if key not in _DATA:
        dm = ImageTextDataModule(
            dataset=args.dataset,
            model=NANO_CONFIG,
            batch_size=batch,
            val_batch_size=val_batch_size,
            num_train=args.num_train,
            num_val=args.num_val,
            seed=args.data_seed,
            augment=False,
        )
        dm.setup("fit")
        _DATA[key] = dm
    dm = _DATA[key]
    dm.hparams.batch_size, dm.hparams.val_batch_size = batch, val_batch_size
    dm.hparams.seed = seed  # the training order's seed
    return dm


def bench_module(loss: str, steps: int, args: argparse.Namespace) -> Any:
    """The FastCLIP benchmarks' module: ``NANO_CONFIG``, 5 % warm-up, ``args.lr``/``temperature`` (SigLIP: its own
    initial temperature), v3's ``rho`` and ``lr_tau`` from ``args``."""
    from lightning_sdp.models import FastCLIPModule

    v3 = loss == "fastclip_v3"
    return FastCLIPModule(
        model=NANO_CONFIG,
        loss=loss,
        lr=args.lr,
        weight_decay=0.1,
        warmup_steps=max(1, steps // 20),
        max_steps=steps,
        temperature=None if loss == "siglip" else args.temperature,
        lr_tau=args.lr_tau if v3 else None,
        rho=args.rho if v3 else None,
    )


def add_training_args(
    parser: argparse.ArgumentParser, dataset: str, datasets: list[str], num_train: int, num_val: int
) -> None:
    """The data and loss options every FastCLIP benchmark shares (its own defaults for the data)."""
    parser.add_argument("--dataset", default=dataset, choices=datasets)
    parser.add_argument("--num-train", type=int, default=num_train)
    parser.add_argument("--num-val", type=int, default=num_val)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--temperature", type=float, default=0.07)
    parser.add_argument("--lr-tau", type=float, default=4e-4, help="v3: logit_scale's lr")
    parser.add_argument("--rho", type=float, default=6.5, help="v3: the paper's CC3M value")


def fit_and_score(module: Any, dm: Any, epochs: int, callbacks: list[Any]) -> dict[str, Any]:
    """Train ``module`` on ``dm`` for ``epochs`` on the CPU, then score it once on the held-out split.

    Returns zero-shot top-1/top-5, image-to-text / text-to-image R@1 and their mean, the final temperature and
    the training wall time (evaluation included once, at the end).
    """
    import lightning.pytorch as pl

    from lightning_sdp.callbacks import ZeroShotEvaluation

    zs = ZeroShotEvaluation()
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=epochs,
        callbacks=[*callbacks, zs],
    )
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    wall = time.perf_counter() - t0
    m = zs.metrics
    return {
        "zeroshot_top1": m["val/zeroshot_top1"],
        "zeroshot_top5": m["val/zeroshot_top5"],
        "i2t_r1": m["val/i2t_r1"],
        "t2i_r1": m["val/t2i_r1"],
        "retrieval_r1": (m["val/i2t_r1"] + m["val/t2i_r1"]) / 2,
        "final_tau": module.temperature,
        "wall_s": wall,
    }


def run_quietly(train: Any, job: tuple[Any, ...]) -> dict[str, Any]:
    """Run ``train(*job)`` in a worker process with Lightning's and Python's warnings silenced."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    return train(*job)


def run_jobs(train_job: Callable[[Any], dict[str, Any]], jobs: Iterable[Any], workers: int) -> Iterator[dict[str, Any]]:
    """Results of ``train_job(job)`` for every job, as they finish: in ``workers`` spawned processes, or in this
    process when ``workers == 1`` (no process start-up: what ``--quick`` uses)."""
    if workers <= 1:
        yield from map(train_job, jobs)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap_unordered(train_job, jobs)


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


GCL_LOSSES = ("fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "sogclr", "isogclr")


def make_u_probe(args: argparse.Namespace, batch: int) -> Any:
    """The u-error diagnostic as a Callback (built inside the worker so Lightning is imported there)."""
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback

    class UErrorProbe(Callback):
        """Median relative error of u (and of a mini-batch estimate) against the full-data inner function."""

        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self._images: torch.Tensor | None = None

        @torch.no_grad()
        def _encode_train(self, trainer: Any, pl_module: Any) -> tuple[torch.Tensor, torch.Tensor]:
            ds = trainer.datamodule.train_set
            images = self._images
            if images is None or trainer.datamodule.hparams.augment:  # a random transform is redrawn every probe
                images = torch.stack([ds.transform(ds.load_image(i)) for i in range(len(ds))])
                self._images = None if trainer.datamodule.hparams.augment else images
            was = pl_module.training
            pl_module.eval()
            e1, e2 = [], []
            for start in range(0, len(ds), 1024):
                e1.append(F.normalize(pl_module.model.encode_image(images[start : start + 1024]), dim=-1))
                e2.append(F.normalize(pl_module.model.encode_text(ds.tokens[start : start + 1024]), dim=-1))
            pl_module.train(was)
            return torch.cat(e1).double(), torch.cat(e2).double()

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            loss = pl_module.gcl_loss
            if loss is None:
                return
            e1, e2 = self._encode_train(trainer, pl_module)
            n = e1.shape[0]
            gen = torch.Generator().manual_seed(12345)
            anchors = torch.randperm(n, generator=gen)[: args.probe_anchors]
            s = 1.0 / pl_module.temperature
            errs: dict[str, list[float]] = {"u": [], "minibatch": []}
            for side, (a, o) in enumerate(((e1, e2), (e2, e1))):
                pos = (a[anchors] * o[anchors]).sum(1, keepdim=True)
                ex = torch.exp((a[anchors] @ o.T - pos) * s)  # (K, n)
                ex[torch.arange(len(anchors)), anchors] = 0.0
                g = ex.sum(1) / (n - 1)
                u = (loss.u1 if side == 0 else loss.u2)[anchors].double()
                errs["u"].append(((u - g).abs() / g)[u > 0])
                # mini-batch estimate: B - 1 random negatives per anchor (several draws)
                for _ in range(4):
                    neg = torch.randint(0, n - 1, (len(anchors), batch - 1), generator=gen)
                    neg = neg + (neg >= anchors[:, None]).long()  # skip the anchor itself
                    gb = ex.gather(1, neg).mean(1)
                    errs["minibatch"].append((gb - g).abs() / g)
            u_err = torch.cat(errs["u"])
            mb_err = torch.cat(errs["minibatch"])
            self.rows.append(
                {
                    "epoch": trainer.current_epoch,
                    "tau": pl_module.temperature,
                    "gamma": loss.gamma,
                    "u_rel_err_median": float(u_err.median()) if u_err.numel() else float("nan"),
                    "u_rel_err_p90": float(u_err.quantile(0.9)) if u_err.numel() else float("nan"),
                    "minibatch_rel_err_median": float(mb_err.median()),
                    "minibatch_rel_err_p90": float(mb_err.quantile(0.9)),
                    "visited": float((u_err.numel()) / (2 * len(anchors))),
                }
            )

    return UErrorProbe()


def train_with_u_probe(
    loss: str, batch: int, seed: int, args: argparse.Namespace, extra_callbacks: tuple[Any, ...] = ()
) -> dict[str, Any]:
    """One training run: zero-shot and retrieval scores, and the u diagnostic at the end of every epoch.

    Args:
        loss: the ``FastCLIPModule`` loss name.
        batch: global batch size.
        seed: seed of the initialisation and of the training order.
        args: the benchmark's arguments.
        extra_callbacks: more callbacks for the Trainer (e.g. another probe); they must not change the training.
    """
    import lightning.pytorch as pl
    import torch

    from lightning_sdp.callbacks import GammaScheduler, TemperatureScheduler

    # One thread per process: on a loaded 2-core machine OpenMP threads spin-wait and cost ~10x the CPU time.
    torch.set_num_threads(args.threads)
    dm = cached_datamodule(args, batch, seed, val_batch_size=500)
    pl.seed_everything(seed, verbose=False)
    steps = args.epochs * (dm.data_size // batch)
    module = bench_module(loss, steps, args)
    probe = make_u_probe(args, batch)
    decay_epochs = max(1, round(args.epochs * args.gamma_decay_fraction))
    gamma = GammaScheduler(gamma_min=args.gamma_min, decay_epochs=decay_epochs)
    scores = fit_and_score(module, dm, args.epochs, [gamma, TemperatureScheduler(), probe, *extra_callbacks])
    return {"loss": loss, "batch": batch, "seed": seed, "steps": steps, **scores, "u_probe": probe.rows}


def summarise_small_batch(runs: list[dict[str, Any]], losses: list[str], batches: list[int]) -> list[dict[str, Any]]:
    """Mean, sample std and min-max range over seeds per (batch, loss); the last epoch's u diagnostic."""
    import numpy as np

    rows = []
    for b in batches:
        for loss in losses:
            sel = [r for r in runs if r["loss"] == loss and r["batch"] == b]
            if not sel:
                continue
            row: dict[str, Any] = {"batch": b, "loss": loss, "seeds": len(sel)}
            for key in ("zeroshot_top1", "zeroshot_top5", "retrieval_r1"):
                vals = np.array([r[key] for r in sel]) * 100
                row[f"{key}_mean"] = float(vals.mean())
                row[f"{key}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
                row[f"{key}_range"] = float(vals.max() - vals.min())
            row["final_tau"] = float(np.mean([r["final_tau"] for r in sel]))
            probes = [r["u_probe"][-1] for r in sel if r.get("u_probe")]
            if probes:
                row["u_err_median"] = float(np.mean([p["u_rel_err_median"] for p in probes]))
                row["minibatch_err_median"] = float(np.mean([p["minibatch_rel_err_median"] for p in probes]))
            row["wall_s"] = float(np.mean([r["wall_s"] for r in sel]))
            rows.append(row)
    return rows


def small_batch_comparisons(summary: list[dict[str, Any]], batches: list[int]) -> list[dict[str, Any]]:
    """FastCLIP-v3 minus each peer, against the seed spread (the larger of the two min-max ranges)."""
    out = []
    for b in batches:
        v3 = next((r for r in summary if r["batch"] == b and r["loss"] == "fastclip_v3"), None)
        for peer in ("openclip", "siglip", "sogclr"):
            o = next((r for r in summary if r["batch"] == b and r["loss"] == peer), None)
            if not (v3 and o):
                continue
            for key in ("zeroshot_top1", "retrieval_r1"):
                spread = max(v3[f"{key}_range"], o[f"{key}_range"])
                delta = v3[f"{key}_mean"] - o[f"{key}_mean"]
                out.append(
                    {
                        "batch": b,
                        "peer": peer,
                        "metric": key,
                        "v3_minus_peer": delta,
                        "seed_spread": spread,
                        "seeds": min(v3["seeds"], o["seeds"]),
                        "beats_by_more_than_spread": bool(delta > spread),
                    }
                )
    return out


def u_probe_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (loss, batch, epoch): the u diagnostic averaged over seeds."""
    import numpy as np

    keys = sorted({(r["loss"], r["batch"]) for r in runs if r.get("u_probe")}, key=lambda k: (k[1], k[0]))
    rows = []
    for loss, b in keys:
        sel = [r["u_probe"] for r in runs if r["loss"] == loss and r["batch"] == b and r.get("u_probe")]
        for e in range(min(len(p) for p in sel)):
            rows.append(
                {
                    "batch": b,
                    "loss": loss,
                    "epoch": e,
                    "gamma": float(np.mean([p[e]["gamma"] for p in sel])),
                    "tau": float(np.mean([p[e]["tau"] for p in sel])),
                    "u_rel_err_median": float(np.mean([p[e]["u_rel_err_median"] for p in sel])),
                    "minibatch_rel_err_median": float(np.mean([p[e]["minibatch_rel_err_median"] for p in sel])),
                    "u_rel_err_p90": float(np.mean([p[e]["u_rel_err_p90"] for p in sel])),
                    "minibatch_rel_err_p90": float(np.mean([p[e]["minibatch_rel_err_p90"] for p in sel])),
                }
            )
    return rows


def small_batch_payload(
    args: argparse.Namespace, runs: list[dict[str, Any]], planned: int, wall_s: float
) -> dict[str, Any]:
    losses = args.losses.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    runs = sorted(runs, key=lambda r: (r["batch"], r["loss"], r["seed"]))
    summary = summarise_small_batch(runs, losses, batches)
    return {
        "args": vars(args),
        "runs": runs,
        "summary": summary,
        "comparisons": small_batch_comparisons(summary, batches),
        "probe": u_probe_table(runs),
        "bench_model": NANO_CONFIG,
        "planned_runs": planned,
        "complete": len(runs) == planned,
        "total_wall_s": wall_s,
        "data_sizes": {"train": args.num_train, "val": args.num_val},
    }
