"""SimpleX / MF-CCL collaborative filtering as a LightningModule, with HEAT's fused CPU kernel as fast path.

Papers: Mao et al., "SimpleX: A Simple and Strong Baseline for Collaborative Filtering" (CIKM 2021) and Zhang et
al., "HEAT: A Highly Efficient and Affordable Training System for Collaborative Filtering Based Recommendation on
CPUs" (ICS 2023). ``backend="reference"`` is plain PyTorch (gather, normalise, ``bmm``, autograd, Adam): the
baseline and the ground truth. ``backend="fused"`` runs HEAT's numba kernel (:mod:`lightning_sdp.kernels.cf_numba`):
per-sample fused forward and backward, lock-free in-place SGD on the touched rows, negatives sampled inside the
kernel. Both share the data module, the metrics and the checkpoint format (the same parameter names).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_sdp.kernels import cf_reference as ref
from lightning_sdp.metrics import NDCGAtK, RecallAtK

_MAX_CHUNKS = 64  # the fused kernel keeps sampler state for at most this many threads


class SimpleXModule(LightningModule):
    """SimpleX (mean aggregator with gate ``g``) and MF-CCL (``g = 1``) trained with the cosine contrastive loss.

    Loss per positive ``(u, i)`` with ``n`` uniform negatives: ``relu(1 - cos(p_u, e_i)) + (w / n) sum_j
    relu(cos(p_u, e_j) - m)``, with ``p_u = g e_u + (1 - g) V mean_{k in H_u \\ {i}} e_k`` and ``H_u`` the user's
    training items capped at ``max_history`` (a fixed seeded subset).

    Args:
        num_users: rows of the user table; ``None`` takes it from the datamodule at ``setup``. Default ``None``.
        num_items: rows of the item table; ``None`` takes it from the datamodule. Default ``None``.
        dim: embedding dimension ``d``. Default 64.
        g: gate between the user row and the aggregated history; ``1.0`` is MF-CCL. SimpleX uses 0.8. Default 1.0.
        aggregator: history aggregator; only ``"mean"`` (SimpleX's attention aggregator is not implemented).
        margin: negative margin ``m``. Default 0.9.
        negative_weight: ``w``, the weight of the negative term. Default 150.
        num_negatives: ``n`` uniform negatives per positive, drawn with replacement. Default 64.
        max_history: cap on the history length ``|H_u|``. Default 100.
        backend: ``"fused"`` (HEAT numba kernel, needs the ``cpu`` extra) or ``"reference"`` (plain PyTorch).
            Default ``"fused"``.
        optimizer: ``"auto"`` (Adam for the reference backend, SGD for fused), ``"adam"`` (reference only),
            ``"sgd"`` or ``"rowwise_adagrad"`` (one Adagrad accumulator per table row, so rows stay independent).
            The fused kernel applies the update per sample (Hogwild); the reference applies it per batch to the mean
            loss. The aggregator ``V`` always gets plain SGD except under Adam. Default ``"auto"``.
        lr: learning rate; ``None`` gives 1e-4 for Adam (the SimpleX setting), 0.05 for SGD and 0.1 for row-wise
            Adagrad. Default ``None``.
        adagrad_eps: row-wise Adagrad's ``eps``. Default 1e-8.
        lr_schedule: ``"constant"`` or ``"linear"`` (decay per step from ``lr`` to 0 over the whole fit,
            ``trainer.estimated_stepping_batches``; set ``max_epochs``). Per-sample SGD on the scale-invariant cosine
            loss keeps a noise floor at a constant rate; decaying it reaches a better optimum. Default ``"constant"``.
        row_norm: after every training step, rescale every user and item row to this L2 norm (SGD projected onto a
            sphere), or ``None`` to leave the norms free. The cosine loss does not depend on row norms, so this changes
            only the optimiser's dynamics: a row's effective step stays ``lr / row_norm**2`` instead of shrinking as
            the row grows (popular items grow fastest and would stop adapting). Default ``None``.
        weight_decay: L2 on the touched user, positive and negative rows (each occurrence). Default 0.
        init_std: standard deviation of the normal initialisation of the tables; ``None`` gives 1e-4 for Adam (the
            SimpleX setting) and 0.1 for SGD (a cosine loss gives gradients ``~1/|e|``, so SGD needs rows that are
            not tiny). Default ``None``.
        sampler: ``"uniform"`` over all items or ``"tile"`` (HEAT: each thread draws from a tile of ``tile_size``
            items redrawn every ``tile_refresh`` samples); the tile sampler exists only in the fused backend.
        tile_size: items per tile. Default 512.
        tile_refresh: samples between tile redraws. Default 2048.
        v_sync: the fused kernel applies each thread's aggregator gradient every this many samples. Default 32.
        aggregator_lr_scale: learning rate of ``V`` relative to ``lr`` (both backends). ``V`` is shared by every
            sample, so per-sample SGD moves it far more often than any embedding row; a smaller scale slows it down.
            Default 1.0.
        aggregator_weight_decay: L2 on ``V`` per sample (both backends). With many negatives, per-sample SGD grows
            ``V`` along history directions the items have since left, until it drowns the history term (Gowalla,
            200 negatives: recall peaks then collapses); a small decay removes those stale directions. Default 0.
        k: cut-off of the logged Recall@K / NDCG@K. Default 20.
        seed: seed of the initialisation, the history subsets and the negative samplers. Default 0.
    """

    def __init__(
        self,
        num_users: int | None = None,
        num_items: int | None = None,
        dim: int = 64,
        g: float = 1.0,
        aggregator: Literal["mean"] = "mean",
        margin: float = 0.9,
        negative_weight: float = 150.0,
        num_negatives: int = 64,
        max_history: int = 100,
        backend: Literal["fused", "reference"] = "fused",
        optimizer: Literal["auto", "adam", "sgd", "rowwise_adagrad"] = "auto",
        lr: float | None = None,
        adagrad_eps: float = 1e-8,
        lr_schedule: Literal["constant", "linear"] = "constant",
        row_norm: float | None = None,
        weight_decay: float = 0.0,
        init_std: float | None = None,
        sampler: Literal["uniform", "tile"] = "uniform",
        tile_size: int = 512,
        tile_refresh: int = 2048,
        v_sync: int = 32,
        aggregator_lr_scale: float = 1.0,
        aggregator_weight_decay: float = 0.0,
        k: int = 20,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if backend not in ("fused", "reference"):
            raise ValueError(f"SimpleXModule: backend must be 'fused' or 'reference', got {backend!r}.")
        if aggregator != "mean":
            raise ValueError(f"SimpleXModule: only the 'mean' aggregator is implemented, got {aggregator!r}.")
        if not 0.0 <= g <= 1.0:
            raise ValueError(f"SimpleXModule: the gate g must be in [0, 1], got {g}.")
        if dim <= 0 or num_negatives <= 0 or max_history < 0 or k <= 0:
            raise ValueError(
                f"SimpleXModule: dim, num_negatives and k must be positive and max_history >= 0; got dim={dim}, "
                f"num_negatives={num_negatives}, max_history={max_history}, k={k}."
            )
        opt = optimizer if optimizer != "auto" else ("adam" if backend == "reference" else "sgd")
        if opt not in ("adam", "sgd", "rowwise_adagrad"):
            raise ValueError(f"SimpleXModule: optimizer must be 'auto', 'adam', 'sgd' or 'rowwise_adagrad', got {optimizer!r}.")
        if backend == "fused" and opt == "adam":
            raise ValueError(
                "SimpleXModule: the fused backend updates rows in place per sample; use optimizer='sgd' or "
                "'rowwise_adagrad' (Adam's per-coordinate state is not kept by the kernel)."
            )
        if lr_schedule not in ("constant", "linear"):
            raise ValueError(f"SimpleXModule: lr_schedule must be 'constant' or 'linear', got {lr_schedule!r}.")
        if row_norm is not None and not row_norm > 0:
            raise ValueError(f"SimpleXModule: row_norm must be positive or None, got {row_norm}.")
        if adagrad_eps <= 0:
            raise ValueError(f"SimpleXModule: adagrad_eps must be positive, got {adagrad_eps}.")
        if sampler not in ("uniform", "tile"):
            raise ValueError(f"SimpleXModule: sampler must be 'uniform' or 'tile', got {sampler!r}.")
        if sampler == "tile" and backend != "fused":
            raise ValueError("SimpleXModule: the tile sampler is part of the fused kernel; use backend='fused'.")
        if sampler == "tile" and (tile_size <= 0 or tile_refresh <= 0):
            raise ValueError(f"SimpleXModule: tile_size and tile_refresh must be positive, got {tile_size}, {tile_refresh}.")
        if aggregator_lr_scale < 0:
            raise ValueError(f"SimpleXModule: aggregator_lr_scale must be >= 0, got {aggregator_lr_scale}.")
        if aggregator_weight_decay < 0:
            raise ValueError(f"SimpleXModule: aggregator_weight_decay must be >= 0, got {aggregator_weight_decay}.")
        if v_sync <= 0:
            raise ValueError(f"SimpleXModule: v_sync must be positive, got {v_sync}.")
        self.save_hyperparameters()
        self.backend = backend
        self.optimizer_name = opt
        self.lr = lr if lr is not None else {"adam": 1e-4, "sgd": 0.05, "rowwise_adagrad": 0.1}[opt]
        self.init_std = init_std if init_std is not None else (1e-4 if opt == "adam" else 0.1)
        self.automatic_optimization = backend == "reference"

        self.user_embedding: nn.Embedding | None = None
        self.item_embedding: nn.Embedding | None = None
        self.aggregator = nn.Parameter(torch.eye(dim))
        # Fused-sampler state (buffers, so it is checkpointed); the reference backend keeps a torch.Generator.
        seeds = np.random.SeedSequence(seed).generate_state(_MAX_CHUNKS, dtype=np.uint64).view(np.int64)
        self.register_buffer("sampler_rng", torch.from_numpy(seeds.copy()))
        self.register_buffer("sampler_tiles", torch.zeros(_MAX_CHUNKS, tile_size if sampler == "tile" else 0, dtype=torch.long))
        self.register_buffer("sampler_tile_left", torch.zeros(_MAX_CHUNKS, dtype=torch.long))
        self._generator = torch.Generator().manual_seed(seed)
        if num_users is not None and num_items is not None:
            self._build_tables(num_users, num_items)

        self._train_indptr: np.ndarray | None = None
        self._train_indices: np.ndarray | None = None
        self._hist_indptr: np.ndarray | None = None
        self._hist_indices: np.ndarray | None = None
        self._hist_pad: Tensor | None = None
        self._item_normalized: Tensor | None = None
        self._batch_start = 0.0
        self.val_recall, self.val_ndcg = RecallAtK(k), NDCGAtK(k)
        self.test_recall, self.test_ndcg = RecallAtK(k), NDCGAtK(k)

    # ------------------------------------------------------------------------------------------------ set-up
    def _build_tables(self, num_users: int, num_items: int) -> None:
        if num_users <= 0 or num_items <= 0:
            raise ValueError(f"SimpleXModule: num_users and num_items must be positive, got {num_users}, {num_items}.")
        d = self.hparams.dim
        gen = torch.Generator().manual_seed(self.hparams.seed)
        self.user_embedding = nn.Embedding(num_users, d)
        self.item_embedding = nn.Embedding(num_items, d)
        with torch.no_grad():
            self.user_embedding.weight.normal_(0.0, self.init_std, generator=gen)
            self.item_embedding.weight.normal_(0.0, self.init_std, generator=gen)
        self.hparams["num_users"], self.hparams["num_items"] = num_users, num_items

    @property
    def num_users(self) -> int:
        return self._tables()[0].num_embeddings

    @property
    def num_items(self) -> int:
        return self._tables()[1].num_embeddings

    def _tables(self) -> tuple[nn.Embedding, nn.Embedding]:
        if self.user_embedding is None or self.item_embedding is None:
            raise RuntimeError(
                "SimpleXModule: the embedding tables do not exist yet; pass num_users/num_items or train with a "
                "datamodule that has them (InteractionsDataModule)."
            )
        return self.user_embedding, self.item_embedding

    def set_interactions(self, indptr: np.ndarray, indices: np.ndarray) -> None:
        """Give the model the training interactions (CSR): histories and the items to mask when ranking.

        Called from :meth:`setup` with the datamodule's ``train_csr()``; call it yourself when training without an
        :class:`~lightning_sdp.datamodules.InteractionsDataModule`.

        Args:
            indptr: ``(num_users + 1,)`` offsets.
            indices: item ids of each user's training items.
        """
        indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        indices = np.ascontiguousarray(indices, dtype=np.int64)
        if len(indptr) != self.num_users + 1:
            raise ValueError(
                f"SimpleXModule: the interactions have {len(indptr) - 1} users but the user table has "
                f"{self.num_users} rows."
            )
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_items):
            raise ValueError(
                f"SimpleXModule: item ids must be in [0, {self.num_items}), got [{indices.min()}, {indices.max()}]."
            )
        self._train_indptr, self._train_indices = indptr, indices
        self._hist_indptr, self._hist_indices = ref.cap_history(indptr, indices, self.hparams.max_history, self.hparams.seed)
        self._hist_pad = ref.padded_history(self._hist_indptr, self._hist_indices) if self.hparams.g < 1 else None

    @override
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "train_csr"):
            if self.user_embedding is None:
                self._build_tables(dm.num_users, dm.num_items)
            elif (dm.num_users, dm.num_items) != (self.num_users, self.num_items):
                raise ValueError(
                    f"SimpleXModule: the model has {self.num_users} users x {self.num_items} items but the data has "
                    f"{dm.num_users} x {dm.num_items}; set num_users/num_items to match (or leave them None)."
                )
            if self._train_indptr is None:
                self.set_interactions(*dm.train_csr())
        self._tables()
        if self.backend == "fused":
            world_size = self.trainer.world_size if self._trainer is not None else 1
            if world_size > 1:
                # the fused kernel updates rows in place, outside autograd, so no DDP hook would ever sync them
                raise ValueError(
                    f"SimpleXModule(backend='fused') does not synchronise its tables across processes, but this run "
                    f"has {world_size} of them: use devices=1 (HEAT's threads already use every core of a node) or "
                    "backend='reference' for DDP."
                )
            from lightning_sdp._imports import require

            require("numba", feature="SimpleXModule(backend='fused')")

    @override
    def configure_optimizers(self) -> Any:
        optimizer = self._optimizer()
        if self.hparams.lr_schedule == "constant":
            return optimizer
        total = self.trainer.estimated_stepping_batches
        if not np.isfinite(total) or total <= 0:
            raise ValueError(
                "SimpleXModule(lr_schedule='linear') decays over the whole fit, so it needs a finite length: set "
                f"Trainer(max_epochs=...) or max_steps (estimated_stepping_batches is {total})."
            )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _optimizer(self) -> torch.optim.Optimizer:
        tables = [p for n, p in self.named_parameters() if n != "aggregator"]
        groups = [
            {"params": tables, "lr": self.lr},
            {"params": [self.aggregator], "lr": self.lr * self.hparams.aggregator_lr_scale},
        ]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(groups, lr=self.lr)
        if self.optimizer_name == "rowwise_adagrad":
            groups[1]["rowwise"] = False  # V is shared by every sample: plain SGD, as in the kernel
            return ref.RowWiseAdagrad(groups, lr=self.lr, eps=self.hparams.adagrad_eps)
        # For the fused backend the optimiser only carries the learning rates (schedulers may change them); the
        # kernel applies the updates itself.
        return torch.optim.SGD(groups, lr=self.lr)

    # ------------------------------------------------------------------------------------------------ training
    def _history(self) -> Tensor | None:
        if self.hparams.g >= 1:
            return None
        if self._hist_pad is None:
            raise RuntimeError("SimpleXModule: no training interactions; call set_interactions() or use a datamodule.")
        return self._hist_pad

    def _check_ids(self, users: Tensor, items: Tensor) -> None:
        if users.numel() == 0:
            return
        if int(users.min()) < 0 or int(users.max()) >= self.num_users:
            raise ValueError(f"SimpleXModule: user ids must be in [0, {self.num_users}), got [{int(users.min())}, {int(users.max())}].")
        if int(items.min()) < 0 or int(items.max()) >= self.num_items:
            raise ValueError(f"SimpleXModule: item ids must be in [0, {self.num_items}), got [{int(items.min())}, {int(items.max())}].")

    def reference_loss(self, users: Tensor, items: Tensor, negatives: Tensor, reduction: str = "mean") -> tuple[Tensor, Tensor]:
        """Plain-PyTorch objective and per-sample contrastive loss of a batch with given negatives."""
        user_emb, item_emb = self._tables()
        hp = self.hparams
        return ref.simplex_loss(
            user_emb.weight, item_emb.weight, self.aggregator, users, items, negatives, hp.g, hp.margin,
            hp.negative_weight, self._history(), hp.weight_decay, reduction, hp.aggregator_weight_decay,
        )

    @torch.no_grad()
    def fused_step(
        self,
        users: Tensor,
        items: Tensor,
        lr: float,
        negatives: Tensor | None = None,
        num_threads: int | None = None,
        aggregator_lr: float | None = None,
        row_sums: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Run HEAT's fused kernel on a batch of positives, updating the tables in place; returns per-sample losses.

        Args:
            users: ``(B,)`` user ids.
            items: ``(B,)`` positive item ids.
            lr: SGD learning rate.
            negatives: ``(B, n)`` negatives to use instead of sampling inside the kernel (tests), or ``None``.
            num_threads: parallel chunks; ``None`` uses numba's current thread count.
            aggregator_lr: learning rate of ``V``; ``None`` gives ``lr * aggregator_lr_scale``.
            row_sums: row-wise Adagrad accumulators ``(user_sums, item_sums)`` (float32, updated in place), or
                ``None`` for plain SGD.
        """
        from lightning_sdp.kernels import cf_numba  # numba is imported only here

        user_emb, item_emb = self._tables()
        params = (user_emb.weight, item_emb.weight, self.aggregator)
        if any(p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
            raise RuntimeError(
                "SimpleXModule(backend='fused') needs contiguous float32 tables on the CPU; train with "
                "Trainer(accelerator='heat' or 'cpu', precision='32-true')."
            )
        if self._hist_indptr is None:
            raise RuntimeError("SimpleXModule: no training interactions; call set_interactions() or use a datamodule.")
        self._check_ids(users, items)
        if num_threads is None:
            import numba

            num_threads = numba.get_num_threads()
        chunks = max(1, min(int(num_threads), _MAX_CHUNKS, len(users)))
        if negatives is None:
            given = np.zeros((0, 0), dtype=np.int64)
        else:
            if negatives.shape != (len(users), negatives.shape[1]) or negatives.numel() == 0:
                raise ValueError(f"SimpleXModule: negatives must be (B, n) with B={len(users)}, got {tuple(negatives.shape)}.")
            given = np.ascontiguousarray(negatives.numpy(), dtype=np.int64)
        hp = self.hparams
        if row_sums is None:
            user_sums = item_sums = np.zeros(0, dtype=np.float32)
        else:
            user_sums, item_sums = (s.numpy() for s in row_sums)
            shapes_ok = user_sums.shape == (self.num_users,) and item_sums.shape == (self.num_items,)
            if not shapes_ok or user_sums.dtype != np.float32 or item_sums.dtype != np.float32:
                raise ValueError(
                    f"SimpleXModule: row_sums must be float32 of shapes ({self.num_users},) and ({self.num_items},), "
                    f"got {user_sums.shape} {user_sums.dtype} and {item_sums.shape} {item_sums.dtype}."
                )
        losses = np.empty(len(users), dtype=np.float32)
        cf_numba.fused_sgd_step(
            user_emb.weight.data.numpy(),
            item_emb.weight.data.numpy(),
            self.aggregator.data.numpy(),
            np.ascontiguousarray(users.numpy(), dtype=np.int64),
            np.ascontiguousarray(items.numpy(), dtype=np.int64),
            self._hist_indptr,
            self._hist_indices,
            given,
            int(hp.num_negatives),
            float(hp.g),
            float(hp.margin),
            float(hp.negative_weight),
            float(lr),
            float(lr * hp.aggregator_lr_scale if aggregator_lr is None else aggregator_lr),
            float(hp.weight_decay),
            float(hp.aggregator_weight_decay),
            user_sums,
            item_sums,
            float(hp.adagrad_eps),
            self.sampler_rng.numpy(),
            self.sampler_tiles.numpy(),
            self.sampler_tile_left.numpy(),
            int(hp.tile_refresh) if hp.sampler == "tile" else 0,
            int(hp.v_sync),
            chunks,
            losses,
        )
        return torch.from_numpy(losses)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        users, items = batch
        if self.backend == "reference":
            self._check_ids(users, items)
            negatives = torch.randint(
                0, self.num_items, (len(users), self.hparams.num_negatives), generator=self._generator
            )
            objective, per_sample = self.reference_loss(users, items, negatives)
            self.log("train/loss", per_sample.mean().detach(), prog_bar=True)
            return objective
        opt = self.optimizers()
        lr = opt.param_groups[0]["lr"]
        row_sums = None
        if self.optimizer_name == "rowwise_adagrad":
            inner = opt.optimizer
            user_emb, item_emb = self._tables()
            row_sums = (inner.row_sums(user_emb.weight), inner.row_sums(item_emb.weight))
        losses = self.fused_step(users, items, lr, aggregator_lr=opt.param_groups[1]["lr"], row_sums=row_sums)
        loss = float(losses.mean())
        if not np.isfinite(loss):
            raise FloatingPointError(
                f"SimpleXModule: the fused kernel produced a non-finite loss at step {self.global_step}; "
                f"lower lr (now {lr}) or raise init_std."
            )
        opt.step()  # no gradients: only advances Lightning's step counter (the kernel already updated the rows)
        # manual optimisation: Lightning leaves stepping step-wise schedulers to the module
        schedules = self.lr_schedulers() or []
        for schedule in schedules if isinstance(schedules, list) else [schedules]:
            schedule.step()
        self.log("train/lr", lr)
        self.log("train/loss", loss, prog_bar=True)
        return None

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.hparams.row_norm is not None:  # after the update of both backends (automatic: after optimizer.step)
            self.project_rows(self.hparams.row_norm)
        elapsed = time.perf_counter() - self._batch_start
        if elapsed > 0:
            self.log("train/positives_per_sec", float(len(batch[0]) / elapsed))

    @torch.no_grad()
    def project_rows(self, norm: float) -> None:
        """Rescale every user and item row to L2 norm ``norm`` in place (all-zero rows stay zero)."""
        if self.backend == "fused":  # one threaded pass per table instead of torch's two passes per batch
            from lightning_sdp.kernels import cf_numba

            for table in self._tables():
                cf_numba.project_rows(table.weight.detach().numpy(), float(norm))
        else:
            for table in self._tables():
                ref.project_rows(table.weight, norm)

    # ------------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def user_vectors(self, users: Tensor) -> Tensor:
        """Evaluation user vectors (full capped history, nothing excluded)."""
        user_emb, item_emb = self._tables()
        return ref.user_vectors(user_emb.weight, item_emb.weight, self.aggregator, users, self.hparams.g, self._history())

    @torch.no_grad()
    def score(self, users: Tensor) -> Tensor:
        """Cosine scores ``(B, num_items)`` of ``users`` against every item."""
        item_n = self._item_normalized
        if item_n is None:
            item_n = F.normalize(self._tables()[1].weight, dim=-1, eps=1e-12)
        return ref.normalized_scores(self.user_vectors(users), item_n)

    def _train_mask(self, users: Tensor) -> Tensor:
        if self._train_indptr is None:
            raise RuntimeError("SimpleXModule: no training interactions to mask; call set_interactions().")
        u = users.numpy()
        starts, stops = self._train_indptr[u], self._train_indptr[u + 1]
        rows = np.repeat(np.arange(len(u)), stops - starts)
        cols = np.concatenate([self._train_indices[a:b] for a, b in zip(starts, stops, strict=False)]) if len(u) else np.zeros(0, np.int64)
        mask = torch.zeros(len(u), self.num_items, dtype=torch.bool)
        mask[torch.from_numpy(rows), torch.from_numpy(cols.astype(np.int64))] = True
        return mask

    def _eval_step(self, batch: dict[str, Tensor], recall: RecallAtK, ndcg: NDCGAtK, prefix: str) -> None:
        users, test_items = batch["users"], batch["test_items"]
        scores = self.score(users)
        exclude = self._train_mask(users)
        scores.masked_fill_(exclude, float("-inf"))
        rows = torch.repeat_interleave(torch.arange(len(users)), batch["test_indptr"].diff())
        relevant = ~exclude[rows, test_items]  # test items that are also training items are never ranked
        target = torch.zeros_like(exclude)
        target[rows[relevant], test_items[relevant]] = True
        k = self.hparams.k
        values, top = scores.topk(min(k, scores.shape[1]), dim=1)
        hits = target.gather(1, top) & (values > float("-inf"))
        num_relevant = torch.bincount(rows[relevant], minlength=len(users))
        recall.update(topk_hits=hits, num_relevant=num_relevant)
        ndcg.update(topk_hits=hits, num_relevant=num_relevant)
        self.log(f"{prefix}/recall@{k}", recall, prog_bar=True, batch_size=len(users))
        self.log(f"{prefix}/ndcg@{k}", ndcg, batch_size=len(users))

    @override
    def on_validation_epoch_start(self) -> None:
        self._item_normalized = F.normalize(self._tables()[1].weight.detach(), dim=-1, eps=1e-12)

    @override
    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    @override
    def on_validation_epoch_end(self) -> None:
        self._item_normalized = None

    @override
    def on_test_epoch_end(self) -> None:
        self._item_normalized = None

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_recall, self.val_ndcg, "val")

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_recall, self.test_ndcg, "test")

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["simplex"] = {"generator_state": self._generator.get_state(), "backend": self.backend}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict", {})
        expected = {
            "user_embedding.weight": None if self.user_embedding is None else tuple(self.user_embedding.weight.shape),
            "item_embedding.weight": None if self.item_embedding is None else tuple(self.item_embedding.weight.shape),
            "aggregator": tuple(self.aggregator.shape),
            "sampler_tiles": tuple(self.sampler_tiles.shape),
        }
        for name, shape in expected.items():
            if name not in state:
                raise ValueError(f"SimpleXModule: the checkpoint has no {name!r}; it is not a SimpleXModule checkpoint.")
            got = tuple(state[name].shape)
            if shape is None and name in ("user_embedding.weight", "item_embedding.weight"):
                continue
            if got != shape:
                raise ValueError(
                    f"SimpleXModule: checkpoint {name!r} has shape {got} but this model has {shape}; the checkpoint "
                    "comes from a different configuration (num_users, num_items, dim or tile_size). Build the model "
                    "with the checkpoint's settings."
                )
        if self.user_embedding is None:
            u, i = state["user_embedding.weight"].shape[0], state["item_embedding.weight"].shape[0]
            self._build_tables(u, i)
        extra = checkpoint.get("simplex")
        if extra is not None:
            self._generator.set_state(extra["generator_state"])
