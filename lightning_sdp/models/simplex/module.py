"""SimpleX / MF-CCL collaborative filtering as a LightningModule, with HEAT's fused CPU kernel as fast path.

Papers: Mao et al., "SimpleX: A Simple and Strong Baseline for Collaborative Filtering" (CIKM 2021) and Zhang et
al., "HEAT: A Highly Efficient and Affordable Training System for Collaborative Filtering Based Recommendation on
CPUs" (ICS 2023). ``backend="reference"`` is plain PyTorch (gather, normalise, ``bmm``, autograd, Adam): the
baseline and the ground truth. ``backend="fused"`` runs HEAT's numba kernel (:mod:`lightning_sdp.kernels.cf_numba`):
per-sample fused forward and backward, lock-free in-place SGD on the touched rows, negatives sampled inside the
kernel. Both share the data module, the metrics and the checkpoint format (the same parameter names).
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_sdp.kernels import cf_reference as ref
from lightning_sdp.metrics import NDCGAtK, RecallAtK
from lightning_sdp.models._checkpoints import VerifiedCheckpoints
from lightning_sdp.models.simplex import kernel
from lightning_sdp.models.simplex.auto import InteractionStats, explain
from lightning_sdp.models.simplex.backends import LearningRates, make_backend
from lightning_sdp.models.simplex.config import Aggregator, Backend, Loss, Optimizer, SimpleXConfig
from lightning_sdp.models.simplex.evaluation import DEFAULT_ITEM_CHUNK, batch_csr, rank_and_score
from lightning_sdp.models.simplex.fold_in import DEFAULT_STEPS, fold_in_user
from lightning_sdp.models.simplex.history import UserHistories
from lightning_sdp.models.simplex.recommend import (
    IdsLike,
    Recommendations,
    as_ids,
    candidate_rows,
    check_finite_rows,
    checked_known_csr,
    known_within,
    remaining_items,
    rows_of_ids,
    top_k_recommendations,
    user_rows,
)
from lightning_sdp.models.simplex.step_log import StepLogWindow, is_log_step
from lightning_sdp.models.simplex.svd_init import svd_factors, warm_start
from lightning_sdp.schedules import LinearDecay


class SimpleXModule(VerifiedCheckpoints, LightningModule):
    """SimpleX (behaviour aggregator with gate ``g``) and MF-CCL (``g = 1``) trained with the cosine contrastive loss.

    Loss per positive ``(u, i)`` with ``n`` uniform negatives: ``relu(1 - cos(p_u, e_i)) + (w / n) sum_j
    relu(cos(p_u, e_j) - m)``, with ``p_u = g e_u + (1 - g) V h_u`` and ``h_u`` the aggregated history ``H_u \\ {i}``
    (the user's training items capped at ``max_history``, a fixed seeded subset). ``loss="softmax"`` trains HEAT's
    code's loss instead: ``-log softmax(cos / temperature)`` of the positive among itself and its negatives.

    After training, :meth:`recommend` gives each user's top-K items (every interaction of the data excluded: the
    training, validation and test items of ``InteractionsDataModule``; in table rows or in the data file's own ids,
    optionally within a subset of items), :meth:`predict_step` does the same per batch for ``trainer.predict``,
    :meth:`similar_items` gives each item's nearest items and :meth:`recommend_for_new_user` folds in a user who was
    not trained on; checkpoints carry what they need (the interactions and the file's ids).

    Args:
        num_users: rows of the user table; ``None`` takes it from the datamodule at ``setup``. Default ``None``.
        num_items: rows of the item table; ``None`` takes it from the datamodule. Default ``None``.
        dim: embedding dimension ``d``. Default 64.
        g: gate between the user row and the aggregated history; ``1.0`` is MF-CCL. SimpleX uses 0.8. Default 1.0.
        aggregator: SimpleX's behaviour aggregator (the official ``BehaviorAggregator``): ``"mean"`` (``h = mean_k
            e_k``), ``"user_attention"`` (``h = sum_k a_k e_k``, ``a = softmax_k(e_u . tanh(W_k e_k + b_k))``) or
            ``"self_attention"`` (a learned query ``q`` instead of ``e_u``); ``W_k``, ``q`` xavier-normal and ``b_k``
            zero as in the official code, trained at ``V``'s rate. Default ``"mean"``.
        margin: negative margin ``m`` (CCL only). Default 0.9.
        negative_weight: ``w``, the weight of the negative term (CCL only). Default 150.
        num_negatives: ``n`` uniform negatives per positive, drawn with replacement. Default 64.
        max_history: cap on the history length ``|H_u|``. Default 100.
        backend: ``"fused"`` (HEAT numba kernel, needs the ``cpu`` extra) or ``"reference"`` (plain PyTorch).
            Default ``"fused"``.
        optimizer: ``"auto"`` (Adam for the reference backend, SGD for fused), ``"adam"`` (reference only),
            ``"sgd"`` or ``"rowwise_adagrad"`` (one Adagrad accumulator per table row, so rows stay independent).
            The fused kernel updates per sample (Hogwild), the reference per batch; the aggregator parameters get
            plain SGD except under Adam. Default ``"auto"``.
        lr: learning rate; ``None`` gives 1e-4 for Adam (the SimpleX setting), 0.05 for SGD and 0.1 for row-wise
            Adagrad. Default ``None``.
        adagrad_eps: row-wise Adagrad's ``eps``. Default 1e-8.
        lr_schedule: ``"constant"`` or ``"linear"`` (from ``lr`` to 0 over ``trainer.estimated_stepping_batches``;
            set ``max_epochs``): a decaying rate gets below per-sample SGD's noise floor. Default ``"constant"``.
        row_norm: after every step, rescale every row to this L2 norm (SGD projected onto a sphere: a row's step
            stays ``lr / row_norm**2`` instead of shrinking as popular rows grow), or ``None``. Default ``None``.
        weight_decay: L2 on the touched user, positive and negative rows (each occurrence). Default 0.
        init_std: standard deviation of the tables' normal initialisation; ``None`` gives 1e-4 for Adam (SimpleX)
            and 0.1 for SGD (a cosine loss's gradients scale as ``1/|e|``). Default ``None``.
        init: ``"normal"``, or ``"svd"``: when the training interactions arrive (:meth:`set_interactions`, at
            ``setup``), the user and item rows start from a truncated SVD of the normalised training matrix, at the
            norm the normal initialisation has (:mod:`~lightning_sdp.models.simplex.svd_init`). Default
            ``"normal"``.
        sampler: ``"uniform"`` over all items or ``"tile"`` (HEAT: each thread draws from a tile of ``tile_size``
            items redrawn every ``tile_refresh`` samples); the tile sampler exists only in the fused backend.
        tile_size: items per tile. Default 512.
        tile_refresh: samples between tile redraws. Default 2048.
        v_sync: the fused kernel applies the sum of each thread's aggregator gradients every this many samples
            (per-sample SGD on ``V``, delayed). HEAT's code applies their mean every 32 samples, the same step at
            ``aggregator_lr_scale=1 / v_sync``; the reference backend steps by the batch mean. Default 32.
        aggregator_lr_scale: learning rate of the aggregator parameters (``V``, ``W_k``, ``b_k``, ``q``: shared by
            every sample, so per-sample SGD moves them far more often than any row) relative to ``lr``. Default 1.0.
        aggregator_weight_decay: L2 on ``V`` per sample (both backends). With many negatives, per-sample SGD grows
            ``V`` along history directions the items have since left, until it drowns the history term (recall
            peaks, then collapses); a small decay removes those stale directions. Default 0.
        dropout: dropout rate on the cosine-normalised user vector during training, inverted scaling (SimpleX's
            ``net_dropout``, as in the official code); never during evaluation. Default 0.
        k: cut-off of the logged Recall@K / NDCG@K. Default 20.
        seed: seed of the initialisation, the history subsets and the negative samplers. Default 0.
        loss: ``"ccl"`` (SimpleX's cosine contrastive loss above), ``"softmax"`` (HEAT's code's loss: cross-entropy
            of the positive among itself and its negatives over ``cos / temperature``; no margin or weight) or
            ``"auto"``: ``"softmax"`` when the training interactions fill at least 0.15% of all user-item pairs,
            else ``"ccl"`` (:mod:`~lightning_sdp.models.simplex.auto`), logged and saved as a hyper-parameter.
            Default ``"auto"``.
        temperature: softmax temperature (``loss="softmax"`` only; HEAT's code uses 0.07). Default 0.07.
        grad_clip: clip each coordinate of the embedding rows' gradients (user, positive, negatives, history rows;
            loss plus weight decay) to ``[-grad_clip, grad_clip]`` before the update, in the way ``grad_clip_mode``
            says; either loss, both backends. Not Lightning's ``gradient_clip_val`` (batch gradient). ``V`` is not
            clipped; with ``g < 1`` it needs the mean aggregator. ``None``: off; ``"auto"``: 0.1 (HEAT's Gowalla
            value) under the softmax loss, else off. Default ``"auto"``.
        grad_clip_mode: ``"sample"`` (ours): clip the gradient each sample gives a row, then step (the reference
            clips each sample's gradient, then averages). ``"row_buffer"`` (HEAT's code: ``sgd.cpp``,
            ``matrix_factorization.cpp``, ``engine.cpp`` of hipdac-lab/ICS23-HEAT): every row keeps a running
            gradient buffer; a sample adds its gradient to the buffer of each row it touches, the buffer is
            clipped in place and the row steps by ``lr`` times the buffer, even when that sample's gradient is 0;
            the buffers are cleared at the start of each epoch, so earlier samples' gradients keep moving a row
            until then. Needs a numeric ``grad_clip`` and ``optimizer="sgd"``; the reference applies it per batch to
            the batch gradient (HEAT's rule exactly with one sample per batch). Default ``"sample"``.
        negatives_exclude_positive: never draw a sample's positive among its negatives (a draw that hits it is
            replaced by a uniform draw among the other items, in both backends). HEAT's sampler skips such a draw
            and keeps that slot's negative from the thread's previous sample instead. ``False`` draws from every
            item. Default ``True``.
        history_grad: whether the history rows get their share of the user vector's gradient (SimpleX, ``g < 1``).
            ``False`` is HEAT's code: they only feed the mean aggregator (and skip the ``d x d`` product that
            carries the gradient to them). Needs ``aggregator="mean"``. Default ``True``.
    """

    # buffers registered in __init__; declared so type checkers see Tensors, not nn.Module.__getattr__'s union
    sampler_rng: Tensor
    sampler_tiles: Tensor
    sampler_tile_left: Tensor
    clip_buffer_user: Tensor
    clip_buffer_item: Tensor

    def __init__(
        self,
        num_users: int | None = None,
        num_items: int | None = None,
        dim: int = 64,
        g: float = 1.0,
        aggregator: Aggregator = "mean",
        margin: float = 0.9,
        negative_weight: float = 150.0,
        num_negatives: int = 64,
        max_history: int = 100,
        backend: Backend = "fused",
        optimizer: Optimizer = "auto",
        lr: float | None = None,
        adagrad_eps: float = 1e-8,
        lr_schedule: Literal["constant", "linear"] = "constant",
        row_norm: float | None = None,
        weight_decay: float = 0.0,
        init_std: float | None = None,
        init: Literal["normal", "svd"] = "normal",
        sampler: Literal["uniform", "tile"] = "uniform",
        tile_size: int = 512,
        tile_refresh: int = 2048,
        v_sync: int = 32,
        aggregator_lr_scale: float = 1.0,
        aggregator_weight_decay: float = 0.0,
        k: int = 20,
        seed: int = 0,
        dropout: float = 0.0,
        loss: Loss | Literal["auto"] = "auto",
        temperature: float = 0.07,
        grad_clip: float | Literal["auto"] | None = "auto",
        grad_clip_mode: Literal["sample", "row_buffer"] = "sample",
        negatives_exclude_positive: bool = True,
        history_grad: bool = True,
    ) -> None:
        super().__init__()
        self.config = SimpleXConfig(
            num_users=num_users,
            num_items=num_items,
            dim=dim,
            g=g,
            aggregator=aggregator,
            margin=margin,
            negative_weight=negative_weight,
            num_negatives=num_negatives,
            max_history=max_history,
            backend=backend,
            optimizer=optimizer,
            lr=lr,
            adagrad_eps=adagrad_eps,
            lr_schedule=lr_schedule,
            row_norm=row_norm,
            weight_decay=weight_decay,
            init_std=init_std,
            init=init,
            sampler=sampler,
            tile_size=tile_size,
            tile_refresh=tile_refresh,
            v_sync=v_sync,
            aggregator_lr_scale=aggregator_lr_scale,
            aggregator_weight_decay=aggregator_weight_decay,
            dropout=dropout,
            k=k,
            seed=seed,
            loss=loss,
            temperature=temperature,
            grad_clip=grad_clip,
            grad_clip_mode=grad_clip_mode,
            negatives_exclude_positive=negatives_exclude_positive,
            history_grad=history_grad,
        )
        self.save_hyperparameters()
        self.backend = make_backend(backend)
        self.automatic_optimization = self.backend.automatic_optimization

        self.user_embedding: nn.Embedding | None = None
        self.item_embedding: nn.Embedding | None = None
        self.aggregator = nn.Parameter(torch.eye(dim))
        self._build_attention(dim, aggregator, seed)
        # Fused-sampler state (buffers, so it is checkpointed); the reference backend keeps a torch.Generator.
        seeds = np.random.SeedSequence(seed).generate_state(kernel.MAX_CHUNKS, dtype=np.uint64).view(np.int64)
        self.register_buffer("sampler_rng", torch.from_numpy(seeds.copy()))
        tile_width = tile_size if sampler == "tile" else 0
        self.register_buffer("sampler_tiles", torch.zeros(kernel.MAX_CHUNKS, tile_width, dtype=torch.long))
        self.register_buffer("sampler_tile_left", torch.zeros(kernel.MAX_CHUNKS, dtype=torch.long))
        # HEAT's running gradient buffers (grad_clip_mode="row_buffer"); (0, dim) otherwise
        self.register_buffer("clip_buffer_user", torch.zeros(0, dim))
        self.register_buffer("clip_buffer_item", torch.zeros(0, dim))
        self.generator = torch.Generator().manual_seed(seed)
        if num_users is not None and num_items is not None:
            self._build_tables(num_users, num_items)

        self._histories: UserHistories | None = None
        self._known: tuple[np.ndarray, np.ndarray] | None = None  # every interaction of the data, see set_known
        self._item_normalized: Tensor | None = None
        self._raw_user_ids: Tensor | None = None  # row -> id in the data file (CSV/TSV input), see set_raw_ids
        self._raw_item_ids: Tensor | None = None
        self.predict_k: int | None = None  # items per user in predict_step; None uses k
        # what the fused backend's set-up did to make the kernel ready (compiled or loaded, seconds), if anything
        self.kernel_preparation: kernel.Preparation | None = None
        self._batch_start = 0.0
        self.log_window = StepLogWindow()  # the fused backend's statistics between two logged steps
        self.val_recall, self.val_ndcg = RecallAtK(k), NDCGAtK(k)
        self.test_recall, self.test_ndcg = RecallAtK(k), NDCGAtK(k)

    # ------------------------------------------------------------------------------------------------ set-up
    def _build_attention(self, dim: int, aggregator: str, seed: int) -> None:
        self.attention_weight: nn.Parameter | None = None
        self.attention_bias: nn.Parameter | None = None
        self.attention_query: nn.Parameter | None = None
        if aggregator == "mean":
            return
        # Official SimpleX init: nn.Linear weights xavier-normal and biases 0; W_q (d x 1) xavier-normal. Their own
        # generator keeps the tables' initialisation the same for every aggregator.
        gen = torch.Generator().manual_seed(seed + 1)
        self.attention_weight = nn.Parameter(torch.randn(dim, dim, generator=gen) * math.sqrt(2.0 / (dim + dim)))
        self.attention_bias = nn.Parameter(torch.zeros(dim))
        if aggregator == "self_attention":
            self.attention_query = nn.Parameter(torch.randn(dim, generator=gen) * math.sqrt(2.0 / (dim + 1)))

    def _build_tables(self, num_users: int, num_items: int) -> None:
        if num_users <= 0 or num_items <= 0:
            raise ValueError(f"SimpleXModule: num_users and num_items must be positive, got {num_users}, {num_items}.")
        d = self.config.dim
        gen = torch.Generator().manual_seed(self.config.seed)
        self.user_embedding = nn.Embedding(num_users, d)
        self.item_embedding = nn.Embedding(num_items, d)
        with torch.no_grad():
            self.user_embedding.weight.normal_(0.0, self.config.initial_std, generator=gen)
            self.item_embedding.weight.normal_(0.0, self.config.initial_std, generator=gen)
        if self.config.grad_clip_mode == "row_buffer":
            self.clip_buffer_user = torch.zeros(num_users, d)
            self.clip_buffer_item = torch.zeros(num_items, d)
        self.hparams["num_users"], self.hparams["num_items"] = num_users, num_items

    @property
    def num_users(self) -> int:
        return self.tables()[0].num_embeddings

    @property
    def num_items(self) -> int:
        return self.tables()[1].num_embeddings

    def tables(self) -> tuple[nn.Embedding, nn.Embedding]:
        """The user and item embedding tables; raises if they do not exist yet."""
        if self.user_embedding is None or self.item_embedding is None:
            raise RuntimeError(
                "SimpleXModule: the embedding tables do not exist yet; pass num_users/num_items or train with a "
                "datamodule that has them (InteractionsDataModule)."
            )
        return self.user_embedding, self.item_embedding

    def attention_weights(self) -> tuple[nn.Parameter | None, nn.Parameter | None, nn.Parameter | None]:
        """``(W_k, b_k, q)`` of the attention aggregator, ``None`` where it has none (all three for the mean)."""
        return self.attention_weight, self.attention_bias, self.attention_query

    def attention_parameters(self) -> list[nn.Parameter]:
        """The learned parameters of an attention aggregator (``W_k``, ``b_k`` and ``q``); empty for the mean."""
        return [p for p in (self.attention_weight, self.attention_bias, self.attention_query) if p is not None]

    def histories(self) -> UserHistories:
        """The training interactions and capped histories given by :meth:`set_interactions`."""
        if self._histories is None:
            raise RuntimeError("SimpleXModule: no training interactions; call set_interactions() or use a datamodule.")
        return self._histories

    def set_interactions(self, indptr: np.ndarray, indices: np.ndarray, warm_start_rows: bool = True) -> None:
        """Give the model the training interactions (CSR): histories and the items to mask when ranking.

        Called from :meth:`setup` with the datamodule's ``train_csr()``; call it yourself when training without an
        :class:`~lightning_sdp.datamodules.InteractionsDataModule`. The ``"auto"`` arguments are chosen for them.

        Args:
            indptr: ``(num_users + 1,)`` offsets.
            indices: item ids of each user's training items.
            warm_start_rows: with ``init="svd"``, start the rows from the SVD of these interactions. Default ``True``.
        """
        if self.config.auto_fields:  # resolve them for these interactions, keep them as hyper-parameters, say why
            stats, fields = InteractionStats.from_csr(indptr, indices, self.num_items), self.config.auto_fields
            self.config = self.config.with_data(stats)
            self.hparams.update({name: getattr(self.config, name) for name in fields})
            rank_zero_info(f"SimpleXModule: {explain(stats)}; grad_clip={self.config.grad_clip}.")
        c = self.config
        self._histories = UserHistories.from_csr(
            indptr, indices, self.num_users, self.num_items, c.max_history, c.seed, padded=c.uses_history
        )
        if c.init == "svd" and warm_start_rows:  # a checkpoint resumed afterwards overwrites the warm start
            users, items = svd_factors(
                self._histories.train_indptr, self._histories.train_indices, self.num_items, c.dim, c.seed
            )
            for table, factors in zip(self.tables(), (users, items), strict=True):
                warm_start(table.weight, factors, c.initial_std)

    def set_known(self, indptr: np.ndarray, indices: np.ndarray) -> None:
        """Give the model every interaction of the data (CSR), which :meth:`recommend` never returns by default.

        Called from :meth:`setup` with the datamodule's ``known_csr`` (training, validation and test items); kept in
        checkpoints. Without it, :meth:`recommend` excludes the training interactions.

        Args:
            indptr: ``(num_users + 1,)`` offsets.
            indices: item rows of each user's interactions.
        """
        self._known = checked_known_csr((indptr, indices), self.num_users, self.num_items, None)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "train_csr"):
            if self.user_embedding is None:
                self._build_tables(dm.num_users, dm.num_items)
            elif (dm.num_users, dm.num_items) != (self.num_users, self.num_items):
                raise ValueError(
                    f"SimpleXModule: the model has {self.num_users} users x {self.num_items} items but the data has "
                    f"{dm.num_users} x {dm.num_items}; set num_users/num_items to match (or leave them None)."
                )
            if self._histories is None:
                csr = dm.train_csr
                # a property on InteractionsDataModule; a method on datamodules written against the older form
                self.set_interactions(*(csr if isinstance(csr, tuple) else csr()))
            known = getattr(dm, "known_csr", None)
            if known is not None:
                self.set_known(*known)
            raw_users, raw_items = getattr(dm, "raw_user_ids", None), getattr(dm, "raw_item_ids", None)
            if raw_users is not None and raw_items is not None:
                self.set_raw_ids(raw_users, raw_items)
        self.tables()
        if self.config.negatives_exclude_positive and self.num_items < 2:
            raise ValueError(
                "SimpleXModule: negatives_exclude_positive=True needs at least 2 items (a negative other than the "
                f"positive), but there are {self.num_items}; add items or pass negatives_exclude_positive=False."
            )
        self.backend.setup(self, self.trainer.world_size if self._trainer is not None else 1)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = self._optimizer()
        if self.config.lr_schedule == "constant":
            return optimizer
        total = self.trainer.estimated_stepping_batches
        if not np.isfinite(total) or total <= 0:
            raise ValueError(
                "SimpleXModule(lr_schedule='linear') decays over the whole fit, so it needs a finite length: set "
                f"Trainer(max_epochs=...) or max_steps (estimated_stepping_batches is {total})."
            )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearDecay(int(total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _optimizer(self) -> torch.optim.Optimizer:
        user_emb, item_emb = self.tables()
        lr = self.config.learning_rate
        groups: list[dict[str, Any]] = [
            {"params": [user_emb.weight, item_emb.weight], "lr": lr},
            {"params": [self.aggregator, *self.attention_parameters()], "lr": lr * self.config.aggregator_lr_scale},
        ]
        name = self.config.optimizer_name
        if name == "adam":
            return torch.optim.Adam(groups, lr=lr)
        if name == "rowwise_adagrad":
            groups[1]["rowwise"] = False  # the aggregator is shared by every sample: plain SGD, as in the kernel
            return ref.RowWiseAdagrad(groups, lr=lr, eps=self.config.adagrad_eps)
        if self.config.grad_clip_mode == "row_buffer" and self.backend.automatic_optimization:
            groups[1]["rowwise"] = False
            buffers = {id(user_emb.weight): self.clip_buffer_user, id(item_emb.weight): self.clip_buffer_item}
            return ref.RowBufferSGD(groups, buffers, float(self.config.grad_clip_value or 0.0), lr=lr)
        if not self.backend.automatic_optimization:
            # the fused kernel applies the updates itself: the optimiser only carries the rates (schedulers change them)
            return LearningRates(groups, lr=lr)
        return torch.optim.SGD(groups, lr=lr)

    # ------------------------------------------------------------------------------------------------ training
    def check_ids(self, users: Tensor, items: Tensor) -> None:
        """Raise a ``ValueError`` if a user or item id is outside the tables."""
        if users.numel() == 0:
            return
        if int(users.min()) < 0 or int(users.max()) >= self.num_users:
            raise ValueError(
                f"SimpleXModule: user ids must be in [0, {self.num_users}), got "
                f"[{int(users.min())}, {int(users.max())}]."
            )
        if int(items.min()) < 0 or int(items.max()) >= self.num_items:
            raise ValueError(
                f"SimpleXModule: item ids must be in [0, {self.num_items}), got "
                f"[{int(items.min())}, {int(items.max())}]."
            )

    def _padded_history(self) -> Tensor | None:
        return self.histories().padded if self.config.uses_history else None

    def reference_loss(
        self,
        users: Tensor,
        items: Tensor,
        negatives: Tensor,
        reduction: str = "mean",
        dropout_mask: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Plain-PyTorch objective and per-sample contrastive loss of a batch with given negatives.

        Args:
            users: ``(B,)`` user ids.
            items: ``(B,)`` positive item ids.
            negatives: ``(B, n)`` negative item ids.
            reduction: ``"mean"`` or ``"sum"`` of the objective over the batch.
            dropout_mask: ``(B, dim)`` inverted-dropout mask on the normalised user vector, or ``None``.
            weights: ``(B,)`` weight of each positive (multiplies its loss), or ``None`` for 1.
        """
        user_emb, item_emb = self.tables()
        c = self.config
        return ref.simplex_loss(
            user_emb.weight,
            item_emb.weight,
            self.aggregator,
            users,
            items,
            negatives,
            c.g,
            c.margin,
            c.negative_weight,
            self._padded_history(),
            c.weight_decay,
            reduction,
            c.aggregator_weight_decay,
            c.aggregator,
            self.attention_weight,
            self.attention_bias,
            self.attention_query,
            dropout_mask,
            loss=c.loss_name,
            temperature=c.temperature,
            grad_clip=None if c.grad_clip_mode == "row_buffer" else c.grad_clip_value,  # the buffers clip instead
            sample_weight=weights,
            history_grad=c.history_grad,
        )

    @torch.no_grad()
    def fused_step(
        self,
        users: Tensor,
        items: Tensor,
        lr: float,
        *,
        weights: Tensor | None = None,
        negatives: Tensor | None = None,
        dropout_masks: Tensor | None = None,
        num_threads: int | None = None,
        aggregator_lr: float | None = None,
        row_sums: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Run HEAT's fused kernel on a batch of positives, updating the parameters in place; returns per-sample losses.

        Args:
            users: ``(B,)`` user ids.
            items: ``(B,)`` positive item ids.
            lr: SGD learning rate.
            weights: ``(B,)`` weight of each positive (multiplies its loss), or ``None`` for 1.
            negatives: ``(B, n)`` negatives to use instead of sampling inside the kernel (tests), or ``None``.
            dropout_masks: ``(B, dim)`` dropout masks to use instead of drawing them inside the kernel (tests), or
                ``None``.
            num_threads: parallel chunks; ``None`` uses numba's current thread count.
            aggregator_lr: learning rate of the aggregator parameters; ``None`` gives ``lr * aggregator_lr_scale``.
            row_sums: row-wise Adagrad accumulators ``(user_sums, item_sums)`` (float32, updated in place), or
                ``None`` for plain SGD.

        Raises:
            FloatingPointError: when a sample reads a NaN or infinite value; the message names the row, and the
                step stopped before that sample changed anything.
        """
        return kernel.fused_step(
            self,
            users,
            items,
            lr,
            weights=weights,
            negatives=negatives,
            dropout_masks=dropout_masks,
            num_threads=num_threads,
            aggregator_lr=aggregator_lr,
            row_sums=row_sums,
        )

    def clip_buffers(self) -> tuple[Tensor, Tensor]:
        """The running gradient buffers of the user and item rows (``grad_clip_mode="row_buffer"``), else ``(0, d)``."""
        return self.clip_buffer_user, self.clip_buffer_item

    @override
    def on_train_epoch_start(self) -> None:
        # HEAT clears its gradient buffers once per epoch (engine.cpp: zero_grad after the epoch's pass)
        for buffer in self.clip_buffers():
            buffer.zero_()

    def describe_bad_user_vector(self, user: int) -> str:
        """Which input of user ``user``'s vector holds a NaN or infinity: its row, a history row or the aggregator."""
        user_emb, item_emb = self.tables()
        if not bool(torch.isfinite(user_emb.weight[user]).all()):
            return f"user row {user}"
        if self.config.uses_history:
            history = self.histories()
            rows = torch.from_numpy(history.indices[history.indptr[user] : history.indptr[user + 1]])
            bad = rows[~torch.isfinite(item_emb.weight[rows]).all(dim=1)]
            if len(bad):
                return f"item row {int(bad[0])} (in user {user}'s history)"
            params = [("the aggregator V", self.aggregator)]
            params += [(f"the attention parameter {n}", p) for n, p in self.named_parameters() if "attention" in n]
            for name, param in params:
                if not bool(torch.isfinite(param).all()):
                    return name
        return f"user {user}'s vector (its inputs are finite: the computation overflowed)"

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor | None:
        # (users, items) or, with a weight column, (users, items, weights)
        users, items, *weights = batch
        return self.backend.training_step(self, users, items, weights[0] if weights else None)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.config.row_norm is not None:  # after the update of both backends (automatic: after optimizer.step)
            self.project_rows(self.config.row_norm)
        self.log_window.add_batch(len(batch[0]), time.perf_counter() - self._batch_start)
        if is_log_step(self.trainer):
            stats = self.log_window.flush()
            if "train/loss" in stats:
                self.log("train/loss", stats.pop("train/loss"), prog_bar=True)
            for name, value in stats.items():
                self.log(name, value)

    @torch.no_grad()
    def project_rows(self, norm: float) -> None:
        """Rescale every user and item row to L2 norm ``norm`` in place (all-zero rows stay zero)."""
        for table in self.tables():
            self.backend.project_rows(table.weight, norm)

    # ------------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def user_vectors(self, users: Tensor) -> Tensor:
        """Evaluation user vectors (full capped history, nothing excluded, no dropout)."""
        user_emb, item_emb = self.tables()
        c = self.config
        return ref.user_vectors(
            user_emb.weight,
            item_emb.weight,
            self.aggregator,
            users,
            c.g,
            self._padded_history(),
            None,
            c.aggregator,
            self.attention_weight,
            self.attention_bias,
            self.attention_query,
        )

    def _normalized_items(self) -> Tensor:
        """The L2-normalised item rows; raises naming the rows that hold NaN or infinite values (they would outrank
        every item)."""
        if self._item_normalized is not None:
            return self._item_normalized
        table = self.tables()[1].weight.detach()
        check_finite_rows(table, "item row")
        return F.normalize(table, dim=-1, eps=1e-12)

    @torch.no_grad()
    def score(self, users: Tensor) -> Tensor:
        """Cosine scores ``(B, num_items)`` of ``users`` against every item."""
        return ref.normalized_scores(self.user_vectors(users), self._normalized_items())

    @torch.no_grad()
    def evaluate_batch(self, batch: dict[str, Tensor], recall: RecallAtK, ndcg: NDCGAtK) -> None:
        """Rank every item for a batch of evaluation users and update ``recall`` and ``ndcg`` with it.

        The items never to rank are the batch's ``known_indptr``/``known_items`` when it has them (the datamodule's
        training items for validation, training + validation items for test), else the training interactions given
        by :meth:`set_interactions`. Scores are streamed in item chunks (:func:`rank_and_score`), so memory is
        bounded by the batch.

        Args:
            batch: ``{"users", "test_indptr", "test_items"}`` and optionally ``{"known_indptr", "known_items"}``.
            recall: the Recall@K metric to update.
            ndcg: the NDCG@K metric to update.
        """
        users = batch["users"]
        if "known_indptr" in batch:
            known = batch["known_indptr"], batch["known_items"]
        else:
            history = self.histories()
            known = batch_csr(history.train_indptr, history.train_indices, users)
        vectors = self.user_vectors(users)
        check_finite_rows(vectors, "user vector", users)
        hits, num_relevant = rank_and_score(
            vectors,
            self._normalized_items(),
            batch["test_indptr"],
            batch["test_items"],
            *known,
            k=self.config.k,
        )
        recall.update(topk_hits=hits, num_relevant=num_relevant)
        ndcg.update(topk_hits=hits, num_relevant=num_relevant)

    def _log_eval(self, batch: dict[str, Tensor], recall: RecallAtK, ndcg: NDCGAtK, prefix: str) -> None:
        self.evaluate_batch(batch, recall, ndcg)
        k, size = self.config.k, len(batch["users"])
        self.log(f"{prefix}/recall@{k}", recall, prog_bar=True, batch_size=size)
        self.log(f"{prefix}/ndcg@{k}", ndcg, batch_size=size)

    @override
    def on_validation_epoch_start(self) -> None:
        self._item_normalized = self._normalized_items()

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
        self._log_eval(batch, self.val_recall, self.val_ndcg, "val")

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._log_eval(batch, self.test_recall, self.test_ndcg, "test")

    # ------------------------------------------------------------------------------------------------ recommendation
    @property
    def raw_user_ids(self) -> Tensor | None:
        """The data file's id of each user row (strictly increasing), or ``None`` when the ids are the rows."""
        return self._raw_user_ids

    @property
    def raw_item_ids(self) -> Tensor | None:
        """The data file's id of each item row (strictly increasing), or ``None`` when the ids are the rows."""
        return self._raw_item_ids

    def set_raw_ids(self, user_ids: np.ndarray | Tensor, item_ids: np.ndarray | Tensor) -> None:
        """Give the model the original ids of its rows, so that :meth:`recommend` can take and give them (``raw_ids``).

        Called from :meth:`setup` with the datamodule's ``raw_user_ids`` / ``raw_item_ids`` (set for CSV/TSV input);
        saved in checkpoints. Rows past the end of a table (``num_users`` / ``num_items`` given larger than the file
        needs) have no raw id.

        Args:
            user_ids: ``(n_u,)`` raw id of user row ``0..n_u-1``, strictly increasing, ``n_u <= num_users``.
            item_ids: ``(n_i,)`` raw id of item row ``0..n_i-1``, strictly increasing, ``n_i <= num_items``.
        """
        tables = []
        for what, ids, rows in (("user", user_ids, self.num_users), ("item", item_ids, self.num_items)):
            t = as_ids(ids, what).cpu()
            if len(t) > rows or (len(t) > 1 and not bool((t[1:] > t[:-1]).all())):
                raise ValueError(
                    f"SimpleXModule.set_raw_ids: the raw {what} ids must be strictly increasing and at most one per "
                    f"{what} row ({rows}), got {len(t)} ids; pass the datamodule's raw_{what}_ids (np.unique order)."
                )
            tables.append(t)
        self._raw_user_ids, self._raw_item_ids = tables

    def recommend(
        self,
        users: IdsLike,
        k: int = 10,
        exclude_known: bool = True,
        known: tuple[np.ndarray | Tensor, np.ndarray | Tensor] | None = None,
        raw_ids: bool = False,
        item_chunk: int = DEFAULT_ITEM_CHUNK,
        items: IdsLike | None = None,
    ) -> Recommendations:
        """The ``k`` best items for each user, by the cosine score of :meth:`score` (the evaluation's ranking).

        Works on a model after ``trainer.fit`` and on one from ``SimpleXModule.load_from_checkpoint`` (checkpoints hold
        the interactions to exclude and the raw ids). Scores are streamed ``item_chunk`` items at a time
        (:func:`~lightning_sdp.models.simplex.recommend.top_k_recommendations`), so memory is bounded by
        ``len(users) x item_chunk`` floats. Example::

            items, scores = model.recommend([0, 5, 7], k=10)  # rows of the tables
            items, scores = model.recommend([1001, 2024], k=10, raw_ids=True)  # ids of the CSV file, both ways
            items, scores = model.recommend([0], k=5, items=in_stock)  # only among the items of in_stock

        Args:
            users: one user id or a list / array / tensor of them: table rows, or the data file's ids with
                ``raw_ids=True``.
            k: items per user. Default 10.
            exclude_known: never recommend a user's known items: ``known`` when given, else every interaction of the
                data the model was fitted on (:meth:`set_known`: with ``InteractionsDataModule`` its training,
                validation and test items), else the training interactions (:meth:`set_interactions`).
                Default ``True``.
            known: ``(indptr, indices)`` CSR of the items never to recommend, over all ``num_users`` rows, in table
                rows (also with ``raw_ids=True``), or ``None`` for the model's own (above). Default ``None``.
            raw_ids: ``users`` and ``items`` are, and the returned items will be, the ids of the CSV/TSV file the model
                was trained on (:attr:`raw_user_ids` / :attr:`raw_item_ids`); an item row without a raw id comes back
                as ``-1``. Default ``False``.
            item_chunk: items scored at once. Default 65536.
            items: recommend only among these items (ids as ``users``); ``None``: every item. Default ``None``.

        Returns:
            :class:`~lightning_sdp.models.simplex.recommend.Recommendations` ``(items, scores)``, each
            ``(len(users), k)`` on the model's device, sorted by score, best first.

        Raises:
            ValueError: for a model without tables (not fitted, not loaded), an unknown user or item id, ``k`` larger
                than the items a user has left, ``raw_ids=True`` on a model without raw ids, ``exclude_known`` with no
                known interactions to exclude, or a user or item row that holds NaN or infinite values.
        """
        self._check_k(k, "recommend")
        ids = as_ids(users, "user")
        rows = self._user_rows(ids, raw_ids)
        known_batch = None
        if exclude_known:
            indptr, indices = self._known_csr(known)
            known_batch = batch_csr(indptr, indices, rows)
        elif known is not None:
            raise ValueError(
                "SimpleXModule.recommend: known= was given with exclude_known=False, so it would be ignored; drop "
                "known= or set exclude_known=True."
            )
        candidates = None if items is None else self._item_rows(items, raw_ids)
        out = self._recommend_rows(rows, int(k), known_batch, candidates, item_chunk, names=ids)
        return self._as_raw_items(out) if raw_ids else out

    def similar_items(
        self, items: IdsLike, k: int = 10, raw_ids: bool = False, item_chunk: int = DEFAULT_ITEM_CHUNK
    ) -> Recommendations:
        """The ``k`` items most similar to each given item: the highest cosine between item rows, the item excluded.

        Args:
            items: one item id or a list / array / tensor of them (table rows, or the data file's ids with
                ``raw_ids=True``).
            k: similar items per item, at most ``num_items - 1``. Default 10.
            raw_ids: take and return the data file's item ids (:attr:`raw_item_ids`). Default ``False``.
            item_chunk: items scored at once. Default 65536.

        Returns:
            :class:`~lightning_sdp.models.simplex.recommend.Recommendations` with ``(len(items), k)`` items and
            their cosines, best first.
        """
        self._check_k(k, "similar_items")
        rows = self._item_rows(items, raw_ids, unique=False)
        table = self.tables()[1].weight.detach()
        itself = (torch.arange(len(rows) + 1), rows.to(table.device))  # each query excludes only itself
        out = self._rank(table[rows.to(table.device)], int(k), itself, None, item_chunk, ("item", rows))
        return self._as_raw_items(out) if raw_ids else out

    def fold_in(self, items: IdsLike, raw_ids: bool = False, steps: int = DEFAULT_STEPS) -> Tensor:
        """The user vector ``(dim,)`` of a user the model was not trained on, from their items.

        The item rows, ``V`` and the attention weights stay as trained; the user's row is the one that minimises the
        model's training loss over their items against every other item
        (:func:`~lightning_sdp.models.simplex.fold_in.fold_in_user`). Score it like a trained user's vector.

        Args:
            items: the user's items (table rows, or the data file's ids with ``raw_ids=True``).
            raw_ids: ``items`` are the data file's ids. Default ``False``.
            steps: L-BFGS iterations. Default 50.
        """
        if as_ids(items, "item").numel() == 0:
            raise ValueError("SimpleXModule: a new user needs at least one item to be folded in.")
        self._normalized_items()  # raises, naming them, if item rows hold NaN or infinite values
        return fold_in_user(self, self._item_rows(items, raw_ids), steps)

    def recommend_for_new_user(
        self,
        items: IdsLike,
        k: int = 10,
        raw_ids: bool = False,
        candidates: IdsLike | None = None,
        steps: int = DEFAULT_STEPS,
    ) -> Recommendations:
        """The ``k`` best items for a user the model was not trained on, from the items they have (never returned).

        The user is folded in (:meth:`fold_in`) without retraining; their items are excluded from the ranking.

        Args:
            items: the new user's items (table rows, or the data file's ids with ``raw_ids=True``).
            k: items to recommend. Default 10.
            raw_ids: ``items`` and ``candidates`` are, and the returned items will be, the data file's ids.
                Default ``False``.
            candidates: recommend only among these items; ``None``: every item. Default ``None``.
            steps: L-BFGS iterations of the fold-in. Default 50.

        Returns:
            :class:`~lightning_sdp.models.simplex.recommend.Recommendations` with ``(k,)`` items and scores, best first.
        """
        self._check_k(k, "recommend_for_new_user")
        rows = self._item_rows(items, raw_ids)
        vector = self.fold_in(rows, steps=steps).unsqueeze(0)
        allowed = None if candidates is None else self._item_rows(candidates, raw_ids)
        own = (torch.tensor([0, len(rows)]), rows)
        out = self._rank(vector, int(k), own, allowed, DEFAULT_ITEM_CHUNK, ("the new user", None))
        out = self._as_raw_items(out) if raw_ids else out
        return Recommendations(out.items[0], out.scores[0])

    def _check_k(self, k: int, method: str) -> None:
        if self.user_embedding is None or self.item_embedding is None:
            raise ValueError(
                f"SimpleXModule.{method}: the model has no embedding tables yet; fit it first (trainer.fit(model, dm)) "
                "or load a trained one (SimpleXModule.load_from_checkpoint(path))."
            )
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise ValueError(f"SimpleXModule.{method}: k must be a positive int, got {k!r}.")

    def _item_rows(self, items: IdsLike, raw_ids: bool, unique: bool = True) -> Tensor:
        """Table rows of item ids (checked); sorted and distinct unless ``unique=False`` (then in the given order)."""
        ids = as_ids(items, "item")
        if raw_ids and self._raw_item_ids is None:
            user_rows(ids, self.num_users, (None, None), has_raw_ids=False)  # raises: the model has no raw ids
        raw = self._raw_item_ids if raw_ids else None
        if unique:
            return candidate_rows(ids, self.num_items, raw)
        if raw is not None:
            rows, found = rows_of_ids(raw, ids.cpu())
            if not bool(found.all()):
                candidate_rows(ids, self.num_items, raw)  # raises, naming the unknown ids
            return rows
        candidate_rows(ids, self.num_items, None)  # checks the range
        return ids.cpu()

    def _as_raw_items(self, out: Recommendations) -> Recommendations:
        """``out`` with its item rows replaced by the data file's ids (``-1`` for a row without one)."""
        if self._raw_item_ids is None:
            raise ValueError("SimpleXModule: raw_ids=True but this model has no raw ids (it was not trained on a CSV).")
        table = self._raw_item_ids.to(out.items.device)
        inside = out.items < len(table)
        items = torch.where(inside, table[out.items.clamp(max=max(len(table) - 1, 0))], -1)
        return Recommendations(items, out.scores)

    def _user_rows(self, ids: Tensor, raw_ids: bool) -> Tensor:
        """Table rows of the user ids given to :meth:`recommend` (checked)."""
        raw = (self._raw_user_ids, self._raw_item_ids) if raw_ids else None
        return user_rows(ids, self.num_users, raw, has_raw_ids=self._raw_user_ids is not None)

    def _known_csr(
        self, known: tuple[np.ndarray | Tensor, np.ndarray | Tensor] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The CSR of items :meth:`recommend` must not return: ``known``, else every known interaction, else the
        training interactions."""
        if known is None and self._known is not None:
            return self._known
        h = self._histories
        training = None if h is None else (h.train_indptr, h.train_indices)
        return checked_known_csr(known, self.num_users, self.num_items, training)

    def _recommend_rows(
        self,
        rows: Tensor,
        k: int,
        known: tuple[Tensor, Tensor] | None,
        candidates: Tensor | None = None,
        item_chunk: int = DEFAULT_ITEM_CHUNK,
        names: Tensor | None = None,
    ) -> Recommendations:
        """Top ``k`` of checked user rows, ``known`` a batch-local CSR; ``names`` are the ids quoted in errors."""
        if self.config.uses_history and self._histories is None:
            raise ValueError(
                f"SimpleXModule.recommend: with g={self.config.g} the user vectors aggregate the training histories, "
                "but the model holds none; call model.set_interactions(*dm.train_csr) (or fit with the datamodule)."
            )
        vectors = self.user_vectors(rows.to(self.tables()[0].weight.device))
        check_finite_rows(vectors, "user vector", rows if names is None else names)
        return self._rank(vectors, k, known, candidates, item_chunk, ("user", rows if names is None else names))

    def _rank(
        self,
        vectors: Tensor,
        k: int,
        known: tuple[Tensor, Tensor] | None,
        candidates: Tensor | None,
        item_chunk: int,
        who: tuple[str, Tensor | None],
    ) -> Recommendations:
        """Top ``k`` items of each query vector, ``known`` a batch-local CSR of items to leave out, ``candidates`` the
        item rows to choose from (``None``: all); ``who`` is what a query is and the ids quoted in errors."""
        items = self._normalized_items()
        if candidates is not None:
            items = items[candidates.to(items.device)]
            if known is not None:
                known = known_within(candidates, self.num_items, known[0], known[1])
        pool = len(items)
        left = torch.full((len(vectors),), pool, dtype=torch.long) if known is None else remaining_items(pool, *known)
        if len(vectors) and int(left.min()) < k:
            at = int(left.argmin())
            excluded = pool - int(left[at])
            scope = f"{pool} items" if candidates is None else f"{pool} candidate items"
            label, names = who
            name = label if names is None else f"{label} {int(names[at])}"
            raise ValueError(
                f"SimpleXModule: k={k} but {name} has only {int(left[at])} items left to recommend ({scope}, "
                f"{excluded} of them known and excluded); ask for k <= {int(left.min())}"
                + (" or pass exclude_known=False." if excluded else ".")
            )
        device = items.device
        known_indptr, known_items = (None, None) if known is None else (known[0].to(device), known[1].to(device))
        out = top_k_recommendations(vectors.to(device), items, k, known_indptr, known_items, item_chunk)
        if candidates is None:
            return out
        return Recommendations(candidates.to(device)[out.items], out.scores)

    @override
    def predict_step(
        self,
        batch: Tensor | list[Tensor] | tuple[Tensor, ...] | dict[str, Tensor],
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> Recommendations:
        """Recommend for a batch of users: ``trainer.predict`` returns one :class:`Recommendations` per batch.

        A batch is a LongTensor of user rows (or a one-tensor list, as a ``TensorDataset`` gives), whose known
        interactions are excluded (as :meth:`recommend` does), or an evaluation batch dict of
        ``InteractionsDataModule`` (``"users"``, and the ``"known_indptr"`` / ``"known_items"`` to exclude:
        ``trainer.predict(model, datamodule=dm)`` excludes every interaction of the data,
        ``trainer.predict(model, dataloaders=dm.test_dataloader())`` the training and validation items).
        Each user gets ``predict_k`` items (an attribute, ``None`` by default: the module's ``k``), in table rows
        (map them with :attr:`raw_item_ids`). For example::

            loader = DataLoader(torch.arange(model.num_users), batch_size=1024)
            batches = trainer.predict(model, dataloaders=loader)
            items = torch.cat([b.items for b in batches])  # (num_users, k)

        Args:
            batch: ``(B,)`` user rows, ``[users]``, or a dict with ``"users"`` and optionally ``"known_indptr"`` /
                ``"known_items"`` (batch-local CSR of the items to exclude).
            batch_idx: index of the batch.
            dataloader_idx: index of the dataloader.

        Returns:
            :class:`~lightning_sdp.models.simplex.recommend.Recommendations` with ``(B, predict_k)`` items and scores.
        """
        k = self.config.k if self.predict_k is None else self.predict_k
        if isinstance(batch, dict):
            users = batch["users"]
        else:
            users = batch[0] if isinstance(batch, (list, tuple)) else batch
        rows = self._user_rows(as_ids(users), raw_ids=False)
        if isinstance(batch, dict) and "known_indptr" in batch:
            known = batch["known_indptr"], batch["known_items"]
        else:
            known = batch_csr(*self._known_csr(None), rows)
        return self._recommend_rows(rows, k, known)

    @override
    def on_predict_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    @override
    def on_predict_epoch_end(self) -> None:
        self._item_normalized = None

    # ------------------------------------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["simplex"] = {"generator_state": self.generator.get_state(), "backend": self.backend.name}
        # what recommend() needs besides the weights (tensors, so torch.load(weights_only=True) reads them)
        if self._histories is not None:
            checkpoint["simplex"]["train_indptr"] = torch.from_numpy(self._histories.train_indptr)
            checkpoint["simplex"]["train_indices"] = torch.from_numpy(self._histories.train_indices)
        if self._known is not None:
            checkpoint["simplex"]["known_indptr"] = torch.from_numpy(self._known[0])
            checkpoint["simplex"]["known_indices"] = torch.from_numpy(self._known[1])
        if self._raw_user_ids is not None and self._raw_item_ids is not None:
            checkpoint["simplex"]["raw_user_ids"] = self._raw_user_ids
            checkpoint["simplex"]["raw_item_ids"] = self._raw_item_ids

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict", {})
        expected = {
            "user_embedding.weight": None if self.user_embedding is None else tuple(self.user_embedding.weight.shape),
            "item_embedding.weight": None if self.item_embedding is None else tuple(self.item_embedding.weight.shape),
            "aggregator": tuple(self.aggregator.shape),
            "sampler_tiles": tuple(self.sampler_tiles.shape),
            "clip_buffer_user": None if self.user_embedding is None else tuple(self.clip_buffer_user.shape),
            "clip_buffer_item": None if self.item_embedding is None else tuple(self.clip_buffer_item.shape),
        }
        expected.update({name: tuple(p.shape) for name, p in self.named_parameters() if name.startswith("attention_")})
        if self.config.grad_clip_mode == "sample":  # checkpoints written before the buffers existed hold none
            for name in ("clip_buffer_user", "clip_buffer_item"):
                state.setdefault(name, torch.zeros(0, self.config.dim))
        for name, shape in expected.items():
            if name not in state:
                raise ValueError(
                    f"SimpleXModule: the checkpoint has no {name!r}; it is not a checkpoint of this configuration "
                    f"(aggregator={self.config.aggregator!r}). Build the model with the checkpoint's settings."
                )
            got = tuple(state[name].shape)
            if shape is None:  # the tables (and their buffers) are built from the checkpoint's shapes below
                continue
            if got != shape:
                raise ValueError(
                    f"SimpleXModule: checkpoint {name!r} has shape {got} but this model has {shape}; the checkpoint "
                    "comes from a different configuration (num_users, num_items, dim, tile_size or grad_clip_mode). "
                    "Build the model with the checkpoint's settings."
                )
        extra_attention = sorted(n for n in state if n.startswith("attention_") and n not in expected)
        if extra_attention:
            raise ValueError(
                f"SimpleXModule: the checkpoint has attention parameters {extra_attention} but this model uses "
                f"aggregator={self.config.aggregator!r}; build it with the checkpoint's aggregator."
            )
        if self.user_embedding is None:
            u, i = state["user_embedding.weight"].shape[0], state["item_embedding.weight"].shape[0]
            self._build_tables(u, i)
        extra = checkpoint.get("simplex")
        if extra is not None:
            self.generator.set_state(extra["generator_state"])
            # a resumed fit already has them from the datamodule (setup runs first); load_from_checkpoint does not
            if self._histories is None and "train_indptr" in extra:
                csr = extra["train_indptr"].cpu().numpy(), extra["train_indices"].cpu().numpy()
                self.set_interactions(*csr, warm_start_rows=False)  # the checkpoint's weights follow
            if self._known is None and "known_indptr" in extra:
                self.set_known(extra["known_indptr"].cpu().numpy(), extra["known_indices"].cpu().numpy())
            if self._raw_user_ids is None and "raw_user_ids" in extra:
                self.set_raw_ids(extra["raw_user_ids"], extra["raw_item_ids"])
