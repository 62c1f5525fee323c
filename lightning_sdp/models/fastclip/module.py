"""``FastCLIPModule``: CLIP training with FastCLIP's compositional losses as a LightningModule.

Paper: Wei et al., "FastCLIP: A Suite of Optimization Techniques to Accelerate CLIP Training with Limited
Resources", arXiv 2407.01445.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, cast

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_sdp.models._checkpoints import VerifiedCheckpoints
from lightning_sdp.models.fastclip.accumulation import HeldBatches, closes_window, placeholder_loss
from lightning_sdp.models.fastclip.lamb import Lamb
from lightning_sdp.models.fastclip.losses import (
    DEFAULT_EPS,
    DEFAULT_SIGLIP_BIAS,
    GlobalContrastiveLoss,
    LossOutput,
    TemperatureGradient,
    build_loss,
    get_variant,
)
from lightning_sdp.schedules import WarmupCosine


class _Encoders(Protocol):
    """What the module calls on its model (``build_clip`` checks that a custom model defines both)."""

    def encode_image(self, images: Tensor) -> Tensor: ...

    def encode_text(self, tokens: Tensor) -> Tensor: ...


class FastCLIPModule(VerifiedCheckpoints, LightningModule):
    """Contrastive image-text training with OpenCLIP's loss or one of FastCLIP's (default: FastCLIP-v3).

    Batches are ``(images, tokens, indices)``: ``indices`` are the samples' dataset indices, which address the
    per-sample estimators ``u`` (and v2's per-sample temperatures). Pair it with the callbacks
    :class:`~lightning_sdp.callbacks.GammaScheduler` (inner learning rate per epoch) and
    :class:`~lightning_sdp.callbacks.TemperatureScheduler` (temperature clamp, v3's learning-rate rule, logging);
    it provides what their protocols :class:`~lightning_sdp.callbacks.fastclip.GammaModule` and
    :class:`~lightning_sdp.callbacks.fastclip.TemperatureModule` describe (``variant``, ``gcl_loss``,
    ``logit_scale_parameter()``, ``tau_lr_factor``). With ``Trainer(accumulate_grad_batches=k)`` the ``k``
    micro-batches of an optimizer step form one contrastive batch (as open_clip's ``--accum-freq``). A module built
    from an ``nn.Module`` is loaded with ``FastCLIPModule.load_from_checkpoint(path, model=<the same architecture>)``.

    Args:
        model: ``"tiny"`` or ``"nano"`` (bundled ~1.7M / ~0.8M-parameter open_clip configs for CPUs, see
            :mod:`lightning_sdp.integrations.open_clip`), an open_clip model name such as
            ``"ViT-B-32"`` (random init unless ``pretrained``), an open_clip config dict, or any ``nn.Module`` with
            ``encode_image`` and ``encode_text``. Default ``"tiny"``.
        loss: ``openclip``, ``siglip``, ``sogclr``, ``isogclr``, ``fastclip_v0``, ``fastclip_v1``, ``fastclip_v2``
            or ``fastclip_v3``. Default ``fastclip_v3``.
        data_size: number of training samples; ``None`` takes the datamodule's ``data_size`` at ``setup``.
        pretrained: path of a local open_clip checkpoint for a named model. Default ``None`` (random init).
        lr: peak learning rate of the model weights. Default 1e-3.
        weight_decay: AdamW/LAMB weight decay (not on gains, biases, embeddings' norms or logit_scale). Default 0.1.
        betas: optimiser moment decays. Default (0.9, 0.98).
        optimizer_eps: optimiser epsilon. Default 1e-6.
        optimizer: ``adamw`` or ``lamb`` (the official code's LAMB: trust ratio only on tensors with weight decay).
            Default ``adamw``.
        warmup_steps: linear warm-up steps of the cosine schedule. Default 100.
        max_steps: length of the cosine schedule; ``None`` uses the trainer's estimated stepping batches.
        min_lr_ratio: final learning rate as a fraction of ``lr``. Default 0.
        temperature: initial (learnable), fixed (constant) or initial individual temperature. Default (from
            ``losses.DEFAULT_TEMPERATURE``): 0.07 for global temperatures, 0.03 for individual ones, 0.1 for SigLIP.
        lr_tau: learnable global temperature: learning rate of ``logit_scale`` (default ``lr``; v3's paper scripts
            use 2e-4 to 5e-5). Individual temperatures: step size of their Adam-like update (default 0.0133).
        rho: KL radius of RGCL (v2, iSogCLR; default 7.0) and RGCL-g (v3; default 6.5), from ``losses.DEFAULT_RHO``.
        eps: epsilon of the compositional losses. Default 1e-14.
        temperature_gradient: ``reference`` (default: the official code's gradients, for which its published
            ``rho`` and ``lr_tau`` were tuned) or ``exact`` (the exact gradient of the objective); see
            :class:`~lightning_sdp.models.fastclip.losses.GlobalContrastiveLoss`.
        logit_bias_init: SigLIP only: initial value of the learnable logit bias. Default -10 (the paper's).
    """

    tau_lr_factor: Tensor  # registered buffer (declared so type checkers know it is a tensor)

    def __init__(
        self,
        model: str | dict[str, Any] | nn.Module = "tiny",
        loss: str = "fastclip_v3",
        data_size: int | None = None,
        pretrained: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.98),
        optimizer_eps: float = 1e-6,
        optimizer: Literal["adamw", "lamb"] = "adamw",
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        temperature: float | None = None,
        lr_tau: float | None = None,
        rho: float | None = None,
        eps: float = DEFAULT_EPS,
        temperature_gradient: TemperatureGradient = "reference",
        logit_bias_init: float = DEFAULT_SIGLIP_BIAS,
    ) -> None:
        super().__init__()
        self.variant = get_variant(loss)
        if optimizer not in ("adamw", "lamb"):
            raise ValueError(f"optimizer must be 'adamw' or 'lamb', got {optimizer!r}.")
        if temperature_gradient not in ("reference", "exact"):
            raise ValueError(f"temperature_gradient must be 'reference' or 'exact', got {temperature_gradient!r}.")
        if data_size is not None and data_size < 2:
            raise ValueError(f"data_size must be >= 2, got {data_size}.")
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        from lightning_sdp.integrations.open_clip import build_clip

        self._model_spec = model
        self.model = build_clip(model, pretrained)
        mode = self.variant.temperature
        self.temperature_init = float(temperature if temperature is not None else self.variant.temperature_init)
        if not 0.0 < self.temperature_init <= 1.0:
            raise ValueError(f"temperature must be in (0, 1], got {self.temperature_init}.")
        self.rho = float(rho if rho is not None else self.variant.rho)
        if not isinstance(getattr(self.model, "logit_scale", None), nn.Parameter):
            self.logit_scale = nn.Parameter(torch.tensor(0.0))
        scale = self.logit_scale_parameter()
        with torch.no_grad():
            scale.fill_(math.log(1.0 / (self.temperature_init if mode != "individual" else 0.07)))
        scale.requires_grad_(mode == "learnable")
        model_bias = getattr(self.model, "logit_bias", None)
        if self.variant.objective == "sigmoid" and not isinstance(model_bias, nn.Parameter):
            self.logit_bias = nn.Parameter(torch.tensor(float(logit_bias_init)))
        self.register_buffer("tau_lr_factor", torch.tensor(1.0))
        self.loss_fn: nn.Module | None = None
        if data_size is not None or self.variant.objective in ("mbcl", "sigmoid"):
            self._build_loss(data_size)
        self._tokenizer: Callable[..., Tensor] | None = None
        self._held = HeldBatches()  # micro-batches of the current optimizer step (gradient accumulation)

    # ------------------------------------------------------------------ helpers
    @property
    def _hp(self) -> AttributeDict:
        """``self.hparams`` typed for attribute access (Lightning annotates it as a plain ``MutableMapping``)."""
        return cast(AttributeDict, self.hparams)

    @property
    def _encoders(self) -> _Encoders:
        """The model, typed by the encoders it has (``nn.Module.__getattr__`` is typed ``Tensor | Module``)."""
        return cast(_Encoders, self.model)

    def logit_scale_parameter(self) -> nn.Parameter:
        """The ``log(1 / tau)`` parameter (the model's ``logit_scale``, or the module's own when the model has none)."""
        own = self.__dict__.get("_parameters", {}).get("logit_scale")
        # __init__ created our own unless the model's logit_scale is an nn.Parameter
        return cast(nn.Parameter, own if own is not None else self.model.logit_scale)

    def logit_scale_arg(self) -> Tensor | None:
        """What the loss receives: the parameter (learnable), a detached copy (constant) or ``None`` (individual)."""
        mode = self.variant.temperature
        if mode == "individual":
            return None
        scale = self.logit_scale_parameter()
        return scale if mode == "learnable" else scale.detach()

    def logit_bias_parameter(self) -> nn.Parameter | None:
        """SigLIP's learnable logit bias (the model's ``logit_bias`` or the module's own; ``None`` for other losses)."""
        if self.variant.objective != "sigmoid":
            return None
        own = self.__dict__.get("_parameters", {}).get("logit_bias")
        # __init__ created our own unless the model's logit_bias is an nn.Parameter
        return cast(nn.Parameter, own if own is not None else self.model.logit_bias)

    def _build_loss(self, data_size: int | None) -> None:
        individual = self.variant.temperature == "individual"
        loss_fn = build_loss(
            self._hp.loss,
            data_size,
            eps=self._hp.eps,
            rho=self.rho,
            tau_init=self.temperature_init if individual else None,
            lr_tau=self._hp.lr_tau if individual else None,
            temperature_gradient=self._hp.get("temperature_gradient", "reference"),
        )
        self.loss_fn = loss_fn
        if data_size is not None:
            self._hp.data_size = int(data_size)
        # The estimators are kept identical on every rank by the loss's own gather; DDP must not broadcast these
        # data_size-long buffers from rank 0 on every forward (its default broadcast_buffers=True).
        self._ddp_params_and_buffers_to_ignore = [f"loss_fn.{name}" for name, _ in loss_fn.named_buffers()]

    @property
    def data_size(self) -> int | None:
        """Number of training samples the estimators cover (``None`` before it is known)."""
        return self.loss_fn.data_size if isinstance(self.loss_fn, GlobalContrastiveLoss) else self._hp.data_size

    @property
    def gcl_loss(self) -> GlobalContrastiveLoss | None:
        """The compositional loss (``None`` for ``openclip``)."""
        return self.loss_fn if isinstance(self.loss_fn, GlobalContrastiveLoss) else None

    @property
    def tokenizer(self) -> Callable[..., Tensor]:
        """The open_clip tokenizer of the model (``tokenizer(list_of_str) -> LongTensor``)."""
        if self._tokenizer is None:
            from lightning_sdp.integrations.open_clip import tokenizer_for

            self._tokenizer = tokenizer_for(self._model_spec)
        return self._tokenizer

    @property
    def temperature(self) -> float:
        """Current global temperature ``1 / exp(logit_scale)`` (mean of the individual ones for v2 / iSogCLR)."""
        gcl = self.gcl_loss
        if self.variant.temperature == "individual" and gcl is not None:
            return float(torch.cat([gcl.tau1, gcl.tau2]).mean())
        return float(torch.exp(-self.logit_scale_parameter().detach()))

    def encode(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """L2-normalised image and text embeddings."""
        return (
            F.normalize(self._encoders.encode_image(images), dim=-1),
            F.normalize(self._encoders.encode_text(tokens), dim=-1),
        )

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        """Tokenise and encode a list of strings (normalised embeddings on the module's device)."""
        tokens = self.tokenizer(list(texts)).to(self.device)
        return F.normalize(self._encoders.encode_text(tokens), dim=-1)

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Same as :meth:`encode`."""
        return self.encode(images, tokens)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)  # checkpoints written whole and checked before loading
        self._check_datamodule_model()
        if self.loss_fn is None:
            dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            size = getattr(dm, "data_size", None)
            if size is None:
                raise ValueError(
                    f"The {self._hp.loss} loss keeps one estimator per training sample: pass "
                    "FastCLIPModule(data_size=len(train_set)) or use a datamodule with a `data_size` attribute."
                )
            self._build_loss(int(size))
        elif self.data_size is not None and self._trainer is not None:
            dm = getattr(self.trainer, "datamodule", None)
            size = getattr(dm, "data_size", None)
            if size is not None and int(size) > self.data_size:
                raise ValueError(
                    f"The datamodule has {size} training samples but the estimators cover data_size={self.data_size}."
                )

    def _check_datamodule_model(self) -> None:
        """Refuse a datamodule that prepares images for a different image size than the model's."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        dm_model = getattr(getattr(dm, "hparams", None), "model", None)
        if dm_model is None or isinstance(self._model_spec, nn.Module) or not isinstance(dm_model, (str, dict)):
            return
        from lightning_sdp.integrations.open_clip import image_size_of

        ours, theirs = image_size_of(self._model_spec), image_size_of(dm_model)
        if ours != theirs:
            raise ValueError(
                f"The datamodule prepares {theirs}px images (model={dm_model!r}) but the model expects {ours}px. "
                "Give ImageTextDataModule the same `model` as FastCLIPModule."
            )

    @override
    def on_fit_start(self) -> None:
        if self.trainer.accumulate_grad_batches > 1 and self.trainer.strategy.handles_gradient_accumulation:
            raise ValueError(
                f"The {type(self.trainer.strategy).__name__} strategy accumulates gradients itself, so FastCLIPModule "
                "cannot make the accumulated micro-batches one contrastive batch. Use accumulate_grad_batches=1 "
                "(a larger batch) or a strategy such as 'ddp'."
            )
        if self.variant.objective not in ("mbcl", "sigmoid"):
            # Trainer.callbacks is assigned by Lightning's callback connector; the Trainer class does not declare it
            callbacks = self.trainer.callbacks  # type: ignore[attr-defined]
            if self.variant.gamma_schedule is not None and not any(
                type(cb).__name__ == "GammaScheduler" for cb in callbacks
            ):
                gcl = self.gcl_loss
                assert gcl is not None  # setup built the compositional loss of this objective
                warnings.warn(
                    f"No GammaScheduler callback: the {self._hp.loss} loss keeps gamma={gcl.gamma} "
                    "for the whole run. Add lightning_sdp.callbacks.GammaScheduler().",
                    stacklevel=2,
                )

    @override
    def on_train_epoch_start(self) -> None:
        gcl = self.gcl_loss
        if gcl is not None:  # v2's official temperature update depends on the epoch
            gcl.epoch = self.current_epoch

    @override
    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        """One optimizer step's batch, or one micro-batch of it with ``Trainer(accumulate_grad_batches=k)``: then the
        ``k`` micro-batches form one contrastive batch (as open_clip's ``--accum-freq``) and the loss, with FastCLIP's
        estimator update, is computed once, at the last one (see :mod:`~lightning_sdp.models.fastclip.accumulation`).
        """
        images, tokens, indices = self._unpack(batch)
        loss_fn = self.loss_fn
        if loss_fn is None:
            raise RuntimeError(
                f"The {self._hp.loss} loss is built in setup(): train through a Trainer, or pass "
                "FastCLIPModule(data_size=len(train_set))."
            )
        accumulate = int(self.trainer.accumulate_grad_batches) if self._trainer is not None else 1
        if accumulate > 1 and not closes_window(batch_idx, accumulate, self.trainer.num_training_batches):
            self._held.hold(self.encode, images, tokens, indices)
            return placeholder_loss(images)
        e1, e2 = self.encode(images, tokens)
        if len(self._held):
            e1, e2, indices = self._held.release(e1, e2, indices)
        if self.variant.objective == "sigmoid":
            out: LossOutput = loss_fn(e1, e2, indices, self.logit_scale_arg(), self.logit_bias_parameter())
        else:
            out = loss_fn(e1, e2, indices, self.logit_scale_arg())
        b = e1.shape[0]
        self.log("train/loss", out.loss.detach(), prog_bar=True, batch_size=b)
        self.log("train/objective", out.value, batch_size=b)
        if self.gcl_loss is not None:
            self.log("train/gamma", self.gcl_loss.gamma, batch_size=b)
        # Lightning divides the loss by accumulate_grad_batches; this one already covers the whole step
        return out.loss * accumulate

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if len(self._held):
            self._held.clear()
            raise RuntimeError(
                "FastCLIPModule held micro-batches for a later optimizer step, but Lightning steps now: the "
                "accumulation window did not end where expected (every accumulate_grad_batches batches and at the "
                "epoch's last batch). Use a dataloader with a known length, or accumulate_grad_batches=1."
            )

    @override
    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> dict[str, Tensor]:
        images, tokens, indices = self._unpack(batch, check_range=False)
        e1, e2 = self.encode(images, tokens)
        logits = e1 @ e2.T / self.temperature if self.variant.temperature != "individual" else e1 @ e2.T / 0.07
        labels = torch.arange(e1.shape[0], device=e1.device)
        clip_loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        self.log("val/clip_loss", clip_loss, batch_size=e1.shape[0], sync_dist=True)
        return {"image_features": e1, "text_features": e2, "indices": indices}

    def _unpack(self, batch: Sequence[Tensor], check_range: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        if not isinstance(batch, (list, tuple)) or len(batch) < 3:
            raise ValueError(
                "FastCLIPModule expects batches (images, tokens, indices); the indices are the samples' dataset "
                "indices (ImageTextDataModule returns them)."
            )
        return batch[0], batch[1], batch[2]

    @override
    def configure_optimizers(self) -> Any:
        hp = self._hp
        decay, no_decay, tau = [], [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if name.endswith("logit_scale"):
                tau.append(p)
            elif p.ndim < 2 or "bias" in name or ".ln" in name or "bn" in name:
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        lr_tau = hp.lr_tau if (hp.lr_tau is not None and self.variant.temperature == "learnable") else hp.lr
        if tau:
            groups.append({"params": tau, "weight_decay": 0.0, "lr": lr_tau})
        cls = Lamb if hp.optimizer == "lamb" else torch.optim.AdamW
        opt = cls(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.optimizer_eps)
        total = hp.max_steps
        if total is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 10_000
        cosine = WarmupCosine(hp.warmup_steps, max(total, 1), hp.min_lr_ratio)
        lambdas: list[Callable[[int], float]] = [cosine, cosine]
        if tau:
            if self.variant.objective == "rgcl_g":  # v3: constant lr_tau, divided by 3 by TemperatureScheduler
                lambdas.append(lambda step: float(self.tau_lr_factor))
            else:
                lambdas.append(cosine)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["fastclip"] = {"loss": self._hp.loss, "data_size": self.data_size}
        if isinstance(self._model_spec, nn.Module):  # not a hyper-parameter: loading needs it passed again
            checkpoint["fastclip"]["model_class"] = _qualified_name(self._model_spec)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get("fastclip", {})
        self._check_model_given(meta, checkpoint.get("hyper_parameters", {}))
        if meta and meta.get("loss") != self._hp.loss:
            raise ValueError(
                f"The checkpoint was trained with loss={meta.get('loss')!r} but this module uses "
                f"loss={self._hp.loss!r}; resume with the same loss."
            )
        size = meta.get("data_size")
        state = checkpoint.get("state_dict", {})
        if size is None and "loss_fn.u1" in state:
            size = int(state["loss_fn.u1"].shape[0])
        if size is None:
            return
        if self.loss_fn is None:
            self._build_loss(int(size))
        elif self.data_size is not None and self.data_size != size:
            raise ValueError(
                f"The checkpoint's estimators cover data_size={size} but this module has data_size={self.data_size}; "
                "resume on the same training set."
            )

    def _check_model_given(self, meta: dict[str, Any], hparams: dict[str, Any]) -> None:
        """Refuse to load weights of a module built from an ``nn.Module`` into the default model, naming ``model=``."""
        trained_on_module = "model_class" in meta or (bool(hparams) and "model" not in hparams)
        if not trained_on_module or isinstance(self._model_spec, nn.Module):
            return
        cls = meta.get("model_class", "an nn.Module")
        raise ValueError(
            f"The checkpoint was trained with FastCLIPModule(model=<{cls}>): a module's architecture is not a "
            f"hyper-parameter, so this module built model={self._model_spec!r} instead. Pass the same architecture: "
            "FastCLIPModule.load_from_checkpoint(path, model=<a freshly built model of that class>), e.g. "
            "model=open_clip.create_model(name) or model=open_clip.CLIP(**config)."
        )


def _qualified_name(obj: object) -> str:
    """``module.Class`` of an object's type (``open_clip.model.CLIP``)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
