"""FastCLIP (Wei et al., arXiv 2407.01445): CLIP training with compositional contrastive losses.

``FastCLIPModule`` is the LightningModule (imported lazily, so the plain-torch losses in
:mod:`lightning_sdp.models.fastclip.losses` import without Lightning).
"""

from typing import Any

from lightning_sdp.models.fastclip.losses import (
    VARIANTS,
    GlobalContrastiveLoss,
    LossOutput,
    OpenCLIPLoss,
    SigLIPLoss,
    build_loss,
    reference_global_contrastive_loss,
)

__all__ = [
    "VARIANTS",
    "FastCLIPModule",
    "GlobalContrastiveLoss",
    "LossOutput",
    "OpenCLIPLoss",
    "SigLIPLoss",
    "build_loss",
    "reference_global_contrastive_loss",
]


def __getattr__(name: str) -> Any:
    if name == "FastCLIPModule":
        from lightning_sdp.models.fastclip.module import FastCLIPModule

        return FastCLIPModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
