"""FastCLIP callbacks: inner learning rate (gamma) schedule, temperature control, zero-shot evaluation.

Paper: Wei et al., "FastCLIP: A Suite of Optimization Techniques to Accelerate CLIP Training with Limited
Resources", arXiv 2407.01445. The callbacks act on a :class:`~lightning_sdp.models.FastCLIPModule`, or on any
LightningModule that provides what :class:`GammaModule` / :class:`TemperatureModule` describe; a module that lacks
it is refused at ``setup`` with a message naming the missing attributes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override


class FastCLIPVariant(Protocol):
    """The loss variant the callbacks read (``FastCLIPModule.variant``, a row of ``losses.VARIANTS``).

    Attributes:
        objective: ``mbcl``, ``gcl``, ``rgcl`` or ``rgcl_g``; ``rgcl_g`` (FastCLIP-v3) enables
            :class:`TemperatureScheduler`'s ``step_thresh`` rule.
        gamma_schedule: ``cosine``, ``constant`` or ``None``; :class:`GammaScheduler` (``schedule="auto"``) follows it.
        temperature: ``learnable`` or ``constant`` (one global ``logit_scale``) or ``individual`` (per sample).
    """

    @property
    def objective(self) -> str: ...

    @property
    def gamma_schedule(self) -> Literal["cosine", "constant"] | None: ...

    @property
    def temperature(self) -> str: ...


class GammaTarget(Protocol):
    """A loss with per-sample estimators whose inner learning rate ``gamma`` can be set (``GlobalContrastiveLoss``)."""

    gamma: float


class GammaModule(Protocol):
    """What :class:`GammaScheduler` needs of the LightningModule (:class:`~lightning_sdp.models.FastCLIPModule` has it).

    Attributes:
        gcl_loss: the loss whose ``gamma`` is set at every epoch start (for example
            ``lightning_sdp.models.fastclip.losses.build_loss("fastclip_v3", data_size)``), or ``None`` for a loss
            without estimators (then the callback does nothing). May be ``None`` until the module's ``setup``.
        variant: only with ``GammaScheduler(schedule="auto")``: its ``gamma_schedule`` picks the schedule.
    """

    @property
    def gcl_loss(self) -> GammaTarget | None: ...

    @property
    def variant(self) -> FastCLIPVariant: ...


class TemperatureModule(Protocol):
    """What :class:`TemperatureScheduler` needs of the LightningModule (:class:`~lightning_sdp.models.FastCLIPModule`).

    Attributes:
        variant: ``temperature`` picks global (``learnable``/``constant``) or ``individual`` temperatures;
            ``objective == "rgcl_g"`` enables the ``step_thresh`` rule.
        tau_lr_factor: 0-d tensor multiplying the temperature's learning rate (the ``step_thresh`` rule writes it;
            your LR scheduler must read it). Needed only with ``objective == "rgcl_g"`` and ``step_thresh`` set.
        gcl_loss: individual temperatures only: the loss holding ``tau1``, ``tau2`` and ``tau_steps``.
    """

    @property
    def variant(self) -> FastCLIPVariant: ...

    tau_lr_factor: Tensor

    @property
    def gcl_loss(self) -> Any: ...

    def logit_scale_parameter(self) -> Tensor:
        """Global temperatures only: the ``log(1 / tau)`` parameter, clamped in place after every step."""
        ...


def _missing(obj: Any, names: Sequence[str]) -> list[str]:
    """The dotted attribute paths of ``names`` that ``obj`` lacks (``"variant.objective"`` checks both levels)."""
    missing = []
    for name in names:
        target = obj
        for part in name.split("."):
            if not hasattr(target, part):
                missing.append(name)
                break
            target = getattr(target, part)
    return missing


def _refuse(callback: str, protocol: str, pl_module: LightningModule, missing: Sequence[str], why: str) -> None:
    if missing:
        raise TypeError(
            f"{callback} needs a LightningModule that follows lightning_sdp.callbacks.fastclip.{protocol}, but "
            f"{type(pl_module).__name__} lacks {', '.join(repr(m) for m in missing)} ({why}). Use FastCLIPModule, add "
            "these attributes to your module (see docs/fastclip.md, 'The callbacks on your own LightningModule'), "
            f"or remove {callback} from the callbacks."
        )


def gamma_at(epoch: int, gamma_min: float, decay_epochs: int, schedule: Literal["cosine", "constant"]) -> float:
    """FastCLIP's inner learning rate at ``epoch`` (0-based).

    Epoch 0 gives 1. ``cosine``: ``0.5 (1 + cos(pi epoch / E)) (1 - gamma_min) + gamma_min`` for ``epoch < E``,
    then ``gamma_min``. ``constant`` (SogCLR / iSogCLR): ``gamma_min`` from epoch 1 on.

    Args:
        epoch: the epoch.
        gamma_min: final (cosine) or constant value.
        decay_epochs: ``E``, the number of epochs of the cosine decay.
        schedule: ``cosine`` or ``constant``.
    """
    if epoch <= 0:
        return 1.0
    if schedule == "constant" or epoch >= decay_epochs:
        return float(gamma_min)
    return 0.5 * (1.0 + math.cos(math.pi * epoch / decay_epochs)) * (1.0 - gamma_min) + gamma_min


class GammaScheduler(Callback):
    """Set the FastCLIP estimators' inner learning rate gamma at the start of every training epoch.

    The LightningModule must follow :class:`GammaModule`: a ``gcl_loss`` attribute (the loss whose ``gamma`` is set,
    or ``None`` for a loss without estimators) and, with ``schedule="auto"``, a ``variant.gamma_schedule``. A module
    that lacks them is refused at ``setup`` with a ``TypeError`` naming what is missing.

    Args:
        gamma_min: final gamma of the cosine schedule, or the constant gamma. Default 0.8 (paper scripts: 0.2).
        decay_epochs: epochs of the cosine decay from 1 to ``gamma_min``. Default 10 (paper: about half the epochs).
        schedule: ``auto`` (the loss variant's schedule: cosine for FastCLIP, constant for SogCLR / iSogCLR),
            ``cosine`` or ``constant``. Default ``auto``.
    """

    def __init__(
        self, gamma_min: float = 0.8, decay_epochs: int = 10, schedule: Literal["auto", "cosine", "constant"] = "auto"
    ) -> None:
        if not 0.0 < gamma_min <= 1.0:
            raise ValueError(f"gamma_min must be in (0, 1], got {gamma_min}.")
        if decay_epochs < 1:
            raise ValueError(f"decay_epochs must be >= 1, got {decay_epochs}.")
        if schedule not in ("auto", "cosine", "constant"):
            raise ValueError(f"schedule must be 'auto', 'cosine' or 'constant', got {schedule!r}.")
        self.gamma_min = float(gamma_min)
        self.decay_epochs = int(decay_epochs)
        self.schedule = schedule
        self.gamma: float | None = None
        self.epoch: int = -1

    def _schedule_for(self, pl_module: LightningModule) -> Literal["cosine", "constant"]:
        if self.schedule != "auto":
            return self.schedule
        return cast(GammaModule, pl_module).variant.gamma_schedule or "constant"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        needed = ["gcl_loss"] + (["variant.gamma_schedule"] if self.schedule == "auto" else [])
        why = "the loss whose gamma is set each epoch" + (
            "; variant.gamma_schedule picks the schedule with schedule='auto' (or pass schedule='cosine' or 'constant')"
            if self.schedule == "auto"
            else ""
        )
        _refuse("GammaScheduler", "GammaModule", pl_module, _missing(pl_module, needed), why)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loss = cast(GammaModule, pl_module).gcl_loss  # setup checked the protocol
        if loss is None:
            rank_zero_info(
                f"GammaScheduler: {type(pl_module).__name__}.gcl_loss is None (no estimators); gamma is not used."
            )
        elif not hasattr(loss, "gamma"):
            raise TypeError(
                f"GammaScheduler sets gcl_loss.gamma, but {type(pl_module).__name__}.gcl_loss "
                f"({type(loss).__name__}) has no `gamma` attribute. Return the FastCLIP loss "
                "(lightning_sdp.models.fastclip.losses.build_loss) or None from `gcl_loss`."
            )

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loss = cast(GammaModule, pl_module).gcl_loss
        if loss is None:
            return  # openclip: no estimators
        self.epoch = trainer.current_epoch
        self.gamma = gamma_at(self.epoch, self.gamma_min, self.decay_epochs, self._schedule_for(pl_module))
        loss.gamma = self.gamma
        if hasattr(loss, "epoch"):  # v2's official temperature update reads the epoch
            loss.epoch = self.epoch
        pl_module.log("train/gamma_epoch", self.gamma, on_step=False, on_epoch=True, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "gamma": self.gamma,
            "epoch": self.epoch,
            "gamma_min": self.gamma_min,
            "decay_epochs": self.decay_epochs,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.gamma = state_dict.get("gamma")
        self.epoch = int(state_dict.get("epoch", -1))


class TemperatureScheduler(Callback):
    """Keep the temperature in range after each optimizer step, apply v3's threshold rule, log the temperature.

    After every optimizer step (with gradient accumulation: after the last micro-batch of each step): clamps ``logit_scale`` to ``[0, ln(1 / tau_min)]`` (so ``tau >= tau_min``, the
    OpenCLIP clamp to 100 with the default); for FastCLIP-v3 sets the temperature's learning rate to
    ``lr_tau * thresh_factor`` while ``tau <= step_thresh`` and to ``lr_tau`` otherwise, re-checked after every step
    (FastCLIP's ``step_thresh`` rule); logs
    ``train/tau`` (mean) and, for individual temperatures (v2, iSogCLR), ``train/tau_std``, ``train/tau_min``,
    ``train/tau_max`` over the samples visited so far.

    The LightningModule must follow :class:`TemperatureModule`: a ``variant`` (``temperature`` and ``objective``),
    ``logit_scale_parameter()`` for global temperatures, ``gcl_loss`` for individual ones and ``tau_lr_factor`` for
    v3's rule. A module that lacks them is refused at ``setup`` with a ``TypeError`` naming what is missing. The rule
    only works if something multiplies the temperature's learning rate by ``tau_lr_factor`` (``FastCLIPModule``'s LR
    scheduler does); when the factor changes and the learning rate of the parameter group holding
    ``logit_scale_parameter()`` does not follow it one step later, the callback warns once, naming what to read.

    Args:
        tau_min: smallest global temperature. Default 0.01.
        step_thresh: temperature below which v3's ``lr_tau`` is reduced; ``None`` disables the rule. Default 0.03.
        thresh_factor: the reduction factor. Default 1/3.
    """

    def __init__(
        self, tau_min: float = 0.01, step_thresh: float | None = 0.03, thresh_factor: float = 1.0 / 3.0
    ) -> None:
        if not 0.0 < tau_min < 1.0:
            raise ValueError(f"tau_min must be in (0, 1), got {tau_min}.")
        if not 0.0 < thresh_factor <= 1.0:
            raise ValueError(f"thresh_factor must be in (0, 1], got {thresh_factor}.")
        self.tau_min = float(tau_min)
        self.step_thresh = step_thresh
        self.thresh_factor = float(thresh_factor)
        self.switched = False
        # (expected change of the temperature's lr, its lr and a reference group's lr when tau_lr_factor changed)
        self._lr_check: tuple[float, float, float] | None = None
        self._warned_unread = False
        self._step_at_batch_start = -1

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        missing = _missing(pl_module, ["variant.temperature", "variant.objective"])
        if not missing:
            variant = cast(TemperatureModule, pl_module).variant
            if variant.temperature == "individual":
                missing = _missing(pl_module, ["gcl_loss"])
            else:
                has_scale = callable(getattr(pl_module, "logit_scale_parameter", None))
                missing = [] if has_scale else ["logit_scale_parameter()"]
                if variant.objective == "rgcl_g" and self.step_thresh is not None:
                    missing += _missing(pl_module, ["tau_lr_factor"])
        why = (
            "variant.temperature picks global or individual temperatures, logit_scale_parameter() returns the global "
            "log(1/tau) to clamp, gcl_loss holds individual temperatures, tau_lr_factor scales v3's lr_tau"
        )
        _refuse("TemperatureScheduler", "TemperatureModule", pl_module, missing, why)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        module = cast(TemperatureModule, pl_module)  # setup checked the protocol
        if module.variant.temperature == "individual":
            missing = [f"gcl_loss.{n}" for n in ("tau1", "tau2", "tau_steps") if not hasattr(module.gcl_loss, n)]
            _refuse("TemperatureScheduler", "TemperatureModule", pl_module, missing, "the individual temperatures")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # a micro-batch of gradient accumulation: the optimizer has not stepped
        module = cast(TemperatureModule, pl_module)  # setup checked the protocol
        variant = module.variant
        if variant.temperature != "individual":
            scale = module.logit_scale_parameter()
            with torch.no_grad():
                scale.clamp_(0.0, math.log(1.0 / self.tau_min))
            tau = float(torch.exp(-scale.detach()))
            if variant.objective == "rgcl_g" and self.step_thresh is not None:
                # re-checked every step, as the official code does: lr_tau while tau > step_thresh, lr_tau *
                # thresh_factor while tau <= step_thresh (tau may rise above the threshold again)
                below = tau <= self.step_thresh
                self._apply_factor(trainer, module, self.thresh_factor if below else 1.0)
                if below != self.switched:
                    rank_zero_info(
                        f"TemperatureScheduler: tau={tau:.4f} {'<=' if below else '>'} {self.step_thresh}; lr_tau x "
                        f"{self.thresh_factor if below else 1.0:.3g}."
                    )
                self.switched = below
            pl_module.log("train/tau", tau, on_step=True, on_epoch=False, batch_size=1)
            factor = getattr(pl_module, "tau_lr_factor", None)
            if factor is not None:
                pl_module.log("train/tau_lr_factor", float(factor), on_step=True, on_epoch=False, batch_size=1)
            return
        # Trainer.log_every_n_steps is assigned by Lightning's logger connector; the Trainer class does not declare it
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]
        if (trainer.global_step % max(1, every)) != 0:
            return
        loss = module.gcl_loss
        seen = loss.tau_steps > 0
        taus = torch.cat([loss.tau1[seen], loss.tau2[seen]]) if bool(seen.any()) else torch.cat([loss.tau1, loss.tau2])
        pl_module.log("train/tau", float(taus.mean()), on_step=True, on_epoch=False, batch_size=1)
        pl_module.log(
            "train/tau_std", float(taus.std()) if taus.numel() > 1 else 0.0, on_step=True, on_epoch=False, batch_size=1
        )
        pl_module.log("train/tau_min", float(taus.min()), on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("train/tau_max", float(taus.max()), on_step=True, on_epoch=False, batch_size=1)

    def _apply_factor(self, trainer: Trainer, module: TemperatureModule, factor: float) -> None:
        """Write ``tau_lr_factor``; one step after a change, check that the temperature's learning rate followed."""
        if self._lr_check is not None:
            self._warn_if_lr_ignored_factor(trainer, module)
        old = float(module.tau_lr_factor)
        module.tau_lr_factor.fill_(factor)
        # (the buffer may hold the factor in float32: compare with a tolerance)
        if old > 0 and not math.isclose(factor, old, rel_tol=1e-5) and not self._warned_unread:
            lrs = _temperature_lrs(trainer, module.logit_scale_parameter())
            if lrs is not None and lrs[0] > 0 and lrs[1] > 0:
                self._lr_check = (factor / old, *lrs)

    def _warn_if_lr_ignored_factor(self, trainer: Trainer, module: TemperatureModule) -> None:
        assert self._lr_check is not None  # the caller checked
        expected, tau_lr, ref_lr = self._lr_check
        self._lr_check = None
        lrs = _temperature_lrs(trainer, module.logit_scale_parameter())
        if lrs is None or lrs[0] <= 0 or lrs[1] <= 0:
            return
        # the temperature's lr change relative to another group's (cancels a schedule both share)
        change = (lrs[0] / tau_lr) / (lrs[1] / ref_lr)
        if abs(math.log(change) - math.log(expected)) < abs(math.log(change)):
            return  # it followed the factor
        self._warned_unread = True
        rank_zero_warn(
            f"TemperatureScheduler changed {type(module).__name__}.tau_lr_factor (FastCLIP-v3's step_thresh rule) "
            "but the learning rate of the parameter group holding logit_scale_parameter() did not follow it: nothing "
            "reads tau_lr_factor, so the rule does nothing. Multiply that group's learning rate by "
            "float(module.tau_lr_factor), e.g. give it `LambdaLR(optimizer, [..., lambda step: "
            "float(module.tau_lr_factor)])` as FastCLIPModule.configure_optimizers does, or turn the rule off with "
            "TemperatureScheduler(step_thresh=None).",
            category=UserWarning,
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"switched": self.switched}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.switched = bool(state_dict.get("switched", False))


def _temperature_lrs(trainer: Any, scale: Tensor) -> tuple[float, float] | None:
    """The learning rate of the optimizer parameter group holding ``scale`` and of another group of that optimizer
    (1.0 when it has no other), or ``None`` when no optimizer holds ``scale``."""
    for optimizer in getattr(trainer, "optimizers", None) or []:
        tau_lr, ref_lr = None, None
        for group in optimizer.param_groups:
            if any(p is scale for p in group["params"]):
                tau_lr = float(group["lr"])
            elif ref_lr is None:
                ref_lr = float(group["lr"])
        if tau_lr is not None:
            return tau_lr, 1.0 if ref_lr is None else ref_lr
    return None


class ZeroShotEvaluation(Callback):
    """Zero-shot classification and image-text retrieval on the validation split, every validation epoch.

    The zero-shot classifier comes from ``open_clip.build_zero_shot_classifier`` (the normalised mean of the
    normalised text embeddings of each class's prompts; templates may be format strings or callables), fed through
    the module's ``encode_texts(list_of_str)``; top-k accuracy comes from torchmetrics. What this callback adds to
    open_clip's zero-shot code: it runs inside ``validate``/``fit`` on the held-out split, gathers and de-duplicates
    the features of every rank, and reports retrieval too. Retrieval ranks all validation captions for each image
    (``i2t``) and all images for each caption (``t2i``); a hit is any pair with an identical caption (built-in
    sets repeat captions). Logs ``val/zeroshot_top{k}``, ``val/i2t_r{k}``, ``val/t2i_r{k}`` and keeps the last values
    in :attr:`metrics`.

    Args:
        classnames: class names; ``None`` takes ``trainer.datamodule.classnames`` (zero-shot is skipped, with a
            message, when there are none, e.g. CSV data).
        templates: prompt templates (format strings with one ``{}``, or callables ``classname -> prompt``); ``None``
            takes ``trainer.datamodule.templates`` or ``("a photo of a {}.",)``.
        top_k: accuracies to report. Default (1, 5).
        recall_k: retrieval recalls to report. Default (1, 5).
    """

    def __init__(
        self,
        classnames: Sequence[str] | None = None,
        templates: Sequence[str | Callable[[str], str]] | None = None,
        top_k: Sequence[int] = (1, 5),
        recall_k: Sequence[int] = (1, 5),
    ) -> None:
        self.classnames = list(classnames) if classnames is not None else None
        self.templates = list(templates) if templates is not None else None
        self.top_k = tuple(int(k) for k in top_k)
        self.recall_k = tuple(int(k) for k in recall_k)
        self.metrics: dict[str, float] = {}
        self._buf: list[tuple[Tensor, Tensor, Tensor]] = []
        self._warned = False

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._buf = []

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not isinstance(outputs, dict) or "image_features" not in outputs:
            raise ValueError(
                "ZeroShotEvaluation needs validation_step to return image_features, text_features, indices."
            )
        self._buf.append(
            (outputs["image_features"].detach(), outputs["text_features"].detach(), outputs["indices"].detach())
        )

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._buf or trainer.sanity_checking:
            return
        img = torch.cat([b[0] for b in self._buf])
        txt = torch.cat([b[1] for b in self._buf])
        idx = torch.cat([b[2] for b in self._buf])
        self._buf = []
        if trainer.world_size > 1:
            # all_gather of a tensor is a tensor (its annotation also covers collections)
            img, txt, idx = (cast(Tensor, pl_module.all_gather(t)).flatten(0, 1) for t in (img, txt, idx))
        idx, first = _unique_first(idx)
        img, txt = img[first].float(), txt[first].float()
        dm = getattr(trainer, "datamodule", None)
        val_set = getattr(dm, "val_set", None)
        metrics = self.compute(pl_module, img, txt, idx, val_set)
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, rank_zero_only=True)
        self.metrics = metrics

    def compute(self, pl_module: Any, img: Tensor, txt: Tensor, idx: Tensor, val_set: Any) -> dict[str, float]:
        """Metrics for validation features ``img``/``txt`` of the validation samples ``idx``."""
        from torchmetrics.functional.classification import multiclass_accuracy

        out: dict[str, float] = {}
        groups = getattr(val_set, "caption_groups", None)
        groups = groups.to(idx.device)[idx] if groups is not None else idx
        sims = img @ txt.T
        same = groups[:, None] == groups[None, :]
        for k in self.recall_k:
            kk = min(k, sims.shape[1])
            top_t = sims.topk(kk, dim=1).indices
            out[f"val/i2t_r{k}"] = float(same.gather(1, top_t).any(dim=1).float().mean())
            top_i = sims.T.topk(kk, dim=1).indices
            out[f"val/t2i_r{k}"] = float(same.gather(1, top_i).any(dim=1).float().mean())
        classnames = self.classnames or getattr(val_set, "classnames", None)
        labels = getattr(val_set, "labels", None)
        if not classnames or labels is None:
            if not self._warned:
                rank_zero_info("ZeroShotEvaluation: no class names/labels for this data; reporting retrieval only.")
                self._warned = True
            return out
        templates = self.templates or getattr(val_set, "templates", None) or ["a photo of a {}."]
        from lightning_sdp._imports import require

        require("open_clip", feature="zero-shot evaluation")
        from open_clip import build_zero_shot_classifier

        with torch.no_grad():
            was_training = pl_module.training
            pl_module.eval()
            # open_clip builds the classifier (prompts per class, mean of the normalised embeddings, normalised);
            # the module's encode_texts(list_of_str) does the tokenising, so any module with it works
            # open_clip takes all-strings or all-callables; callables let the two be mixed
            prompts = [(lambda c, t=t: t.format(c)) if isinstance(t, str) else t for t in templates]
            weights = build_zero_shot_classifier(
                _TextEncoder(pl_module), _keep_strings, list(classnames), prompts, num_classes_per_batch=None
            )
            pl_module.train(was_training)
        cls = weights.T.float().to(img.device)
        logits = img @ cls.T
        target = labels.to(img.device)[idx]
        for k in self.top_k:
            kk = min(k, len(classnames))
            acc = multiclass_accuracy(logits, target, num_classes=len(classnames), top_k=kk, average="micro")
            out[f"val/zeroshot_top{k}"] = float(acc)
        return out


class _Strings(list):
    """Prompts passed through open_clip's classifier builder untouched (it calls ``tokenizer(texts).to(device)``)."""

    def to(self, *args: Any, **kwargs: Any) -> _Strings:
        return self


def _keep_strings(texts: Sequence[str]) -> _Strings:
    return _Strings(texts)


class _TextEncoder:
    """``encode_text(texts, normalize)`` for open_clip's builder, from the module's ``encode_texts(list_of_str)``."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def encode_text(self, texts: Sequence[str], normalize: bool = True) -> Tensor:
        emb = self.module.encode_texts(list(texts)).float()
        return torch.nn.functional.normalize(emb, dim=-1) if normalize else emb


def _unique_first(idx: Tensor) -> tuple[Tensor, Tensor]:
    """Sorted unique values of ``idx`` and the position of each one's first occurrence."""
    uniq, inverse = torch.unique(idx, return_inverse=True)
    positions = torch.arange(idx.numel(), device=idx.device)
    first = torch.full((uniq.numel(),), idx.numel(), dtype=torch.long, device=idx.device)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return uniq, first
