"""FastCLIP (Wei et al., arXiv 2407.01445): CLIP training with compositional contrastive losses.

``FastCLIPModule`` is the LightningModule; the losses in :mod:`lightning_sdp.models.fastclip.losses` are plain
``nn.Module`` s usable without Lightning.
"""

from lightning_sdp.models.fastclip.losses import (
    VARIANTS,
    GlobalContrastiveLoss,
    LossOutput,
    OpenCLIPLoss,
    build_loss,
    reference_global_contrastive_loss,
)
from lightning_sdp.models.fastclip.module import FastCLIPModule

__all__ = [
    "VARIANTS",
    "FastCLIPModule",
    "GlobalContrastiveLoss",
    "LossOutput",
    "OpenCLIPLoss",
    "build_loss",
    "reference_global_contrastive_loss",
]
