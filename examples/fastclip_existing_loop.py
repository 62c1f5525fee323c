"""Drop FastCLIP's loss into an existing (non-Lightning) open_clip training loop.

The only changes to a plain OpenCLIP loop: the data loader also yields each sample's dataset index, and
``open_clip.ClipLoss`` is replaced by a FastCLIP loss that keeps one estimator per training sample. Under
``torchrun`` with DDP the same code gives the full-global-batch gradient (the loss gathers features without
autograd and is scaled for DDP's gradient averaging).

    .venv/bin/python examples/fastclip_existing_loop.py --epochs 2

The Lightning version of the same thing is ``examples/configs/fastclip_tiny.yaml``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lightning_sdp.callbacks.fastclip import gamma_at
from lightning_sdp.datamodules.image_text import ImageTextDataModule
from lightning_sdp.integrations.open_clip import build_clip
from lightning_sdp.models.fastclip.losses import build_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-train", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    data = ImageTextDataModule(model="tiny", num_train=args.num_train, num_val=64, batch_size=args.batch_size)
    data.setup()
    loader = data.train_dataloader()  # yields (images, tokens, indices)

    model = build_clip("tiny")  # any open_clip CLIP; "ViT-B-32" etc. work the same way
    loss_fn = build_loss("fastclip_v3", data_size=len(data.train_set), rho=6.5)
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n != "logit_scale"]},
            {"params": [model.logit_scale], "lr": 2e-4, "weight_decay": 0.0},
        ],
        lr=1e-3,
        weight_decay=0.1,
    )
    for epoch in range(args.epochs):
        loss_fn.gamma = gamma_at(epoch, gamma_min=0.8, decay_epochs=max(1, args.epochs // 2), schedule="cosine")
        loss_fn.epoch = epoch  # read by v2's per-sample temperature update; harmless for v3
        loader.sampler.set_epoch(epoch)
        for images, tokens, indices in loader:
            e1 = F.normalize(model.encode_image(images), dim=-1)
            e2 = F.normalize(model.encode_text(tokens), dim=-1)
            out = loss_fn(e1, e2, indices, model.logit_scale)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, 4.6052)  # tau >= 0.01
        tau = float(torch.exp(-model.logit_scale.detach()))
        print(f"epoch {epoch}: objective {float(out.value):.4f}, gamma {loss_fn.gamma:.3f}, tau {tau:.4f}")


if __name__ == "__main__":
    main()
