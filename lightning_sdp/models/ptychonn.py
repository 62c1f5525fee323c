"""``PtychoNN``: a small encoder-decoder CNN that inverts diffraction patterns to amplitude and phase.

After Cherukara et al., "AI-enabled high-resolution scanning coherent diffraction imaging" (Appl. Phys. Lett.
117, 2020): one convolutional encoder, two decoders (amplitude with a sigmoid head, phase with ``pi * tanh``).
It is the surrogate of the SOLAR example (:class:`lightning_sdp.datamodules.solar.SolarDataModule`): batches are
dicts with ``input`` (B, C, S, S), ``target`` (B, 2, S, S) (amplitude, phase) and optionally ``loss_scale``; the
loss is ``loss_scale * sum_i l_i`` so that SOLAR's variable local batches give the global-mean gradient under DDP.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_sdp.models._checkpoints import VerifiedCheckpoints


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.ReLU(inplace=True),
    )


class _Decoder(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for c_in, c_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [_block(c_in, c_out), nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)]
        layers.append(nn.Conv2d(widths[-1], 1, 3, padding=1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class PtychoNN(VerifiedCheckpoints, LightningModule):
    """Encoder-decoder CNN from diffraction to (amplitude, phase), trained with a per-sample MSE.

    Args:
        in_channels: input channels. Default 1.
        image_size: input side in pixels; must be divisible by ``2 ** depth``. Default 64.
        base_channels: channels of the first encoder block (doubling per level). Default 16.
        depth: down/up-sampling levels. Default 3.
        learning_rate: optimiser learning rate. Default 1e-3.
        optimizer: ``"adam"`` (default) or ``"sgd"``.
        phase_weight: weight of the phase MSE relative to the amplitude MSE. Default 1.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 64,
        base_channels: int = 16,
        depth: int = 3,
        learning_rate: float = 1e-3,
        optimizer: Literal["adam", "sgd"] = "adam",
        phase_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if image_size % (2**depth):
            raise ValueError(f"image_size ({image_size}) must be divisible by 2**depth = {2**depth}")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()
        widths = [base_channels * 2**i for i in range(depth)]
        enc: list[nn.Module] = []
        c = in_channels
        for w in widths:
            enc += [_block(c, w), nn.MaxPool2d(2)]
            c = w
        self.encoder = nn.Sequential(*enc)
        dec_widths = [widths[-1], *reversed(widths)]
        self.amplitude_head = _Decoder(dec_widths)
        self.phase_head = _Decoder(dec_widths)
        self.example_input_array = torch.zeros(2, in_channels, image_size, image_size)

    @property
    def _hp(self) -> AttributeDict:
        """``self.hparams`` typed for attribute access (Lightning annotates it as a plain ``MutableMapping``)."""
        return cast(AttributeDict, self.hparams)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Expected per-sample input shape ``(C, S, S)``."""
        hp = self._hp
        return (hp.in_channels, hp.image_size, hp.image_size)

    def check_input(self, x: Tensor) -> None:
        """Raise a ``ValueError`` naming the expected and the given shape when ``x`` does not fit."""
        if x.dim() != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"PtychoNN expects inputs of shape (batch, {', '.join(map(str, self.input_shape))}) "
                f"(in_channels, image_size, image_size), got {tuple(x.shape)}; set PtychoNN(in_channels=..., "
                "image_size=...) to match the data"
            )

    @override
    def forward(self, x: Tensor) -> Tensor:
        """``(B, C, S, S)`` diffraction -> ``(B, 2, S, S)``: amplitude in (0, 1), phase in (-pi, pi)."""
        self.check_input(x)
        z = self.encoder(x)
        amplitude = torch.sigmoid(self.amplitude_head(z))
        phase = math.pi * torch.tanh(self.phase_head(z))
        return torch.cat([amplitude, phase], dim=1)

    def per_sample_loss(self, pred: Tensor, target: Tensor) -> Tensor:
        """MSE per sample: amplitude + ``phase_weight`` * phase, each averaged over pixels. Shape ``(B,)``."""
        if target.shape != pred.shape:
            raise ValueError(
                f"PtychoNN expects targets of shape {tuple(pred.shape)} (amplitude, phase), got {tuple(target.shape)}"
            )
        err = (pred - target) ** 2
        amp = err[:, 0].flatten(1).mean(1)
        phase = err[:, 1].flatten(1).mean(1)
        return amp + self._hp.phase_weight * phase

    def _loss(self, batch: dict[str, Tensor] | tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        if isinstance(batch, dict):
            x, y, scale = batch["input"], batch["target"], batch.get("loss_scale")
        else:
            (x, y), scale = batch, None
        losses = self.per_sample_loss(self(x), y)
        n = len(x)
        if scale is None:
            scale = torch.tensor(1.0 / max(n, 1), device=losses.device)
        # sum * scale: SOLAR's P / G keeps the DDP mean equal to the global mean with unequal local batches.
        # An empty local batch still gives a (zero) loss connected to every parameter, so backward runs.
        return losses.sum() * scale.to(losses.dtype), n

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, n = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=max(n, 1))
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, n = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=max(n, 1), sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = self._hp.learning_rate
        if self._hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=lr)
        return torch.optim.Adam(self.parameters(), lr=lr)
