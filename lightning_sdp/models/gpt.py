"""A small decoder-only Transformer (nanoGPT layout) as a LightningModule.

It is the workload the SDP4Bit strategy and the EngineProfiler are measured on. Attention can run through
``scaled_dot_product_attention`` (fused), as explicit ``softmax(QK^T)V`` (unfused: the matrix and vector work the
profiler study separates), or as causal linear attention (``elu + 1`` feature map), whose cost grows linearly with
the sequence length.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_sdp.models._checkpoints import VerifiedCheckpoints
from lightning_sdp.schedules import WarmupCosine

AttentionKind = Literal["sdpa", "explicit", "linear"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a choice of implementation.

    Args:
        n_embd: model width.
        n_head: number of heads; must divide ``n_embd``.
        block_size: longest sequence (sizes the causal mask of the explicit path).
        dropout: dropout on attention weights and the output projection.
        bias: biases in the projections.
        attention: ``"sdpa"`` (fused), ``"explicit"`` (matmul + masked softmax + matmul) or ``"linear"``.
    """

    causal_mask: Tensor  # registered buffer of the explicit path (declared so type checkers know it is a tensor)

    def __init__(
        self, n_embd: int, n_head: int, block_size: int, dropout: float, bias: bool, attention: AttentionKind
    ) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.dropout = dropout
        self.attention = attention
        if attention == "explicit":
            mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
            self.register_buffer("causal_mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        elif self.attention == "explicit":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        else:
            y = _causal_linear_attention(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def _causal_linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float = 1e-6, chunk: int = 64) -> Tensor:
    """Causal linear attention (Katharopoulos et al., 2020) with the ``elu(x) + 1`` feature map.

    Chunked form: inside a chunk of ``chunk`` positions the masked kernel matrix is applied directly; across
    chunks a running ``K^T V`` state carries the prefix. The cost is O(T·(chunk + d)·d) and, unlike a per-position
    prefix sum, it never materialises a ``(T, d, d)`` tensor.
    """
    q, k = F.elu(q) + 1, F.elu(k) + 1
    B, H, T, D = q.shape
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:  # padded positions come after every real one, so causality keeps them out of real outputs
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    q, k, v = (t.reshape(B, H, n, chunk, t.size(-1)) for t in (q, k, v))
    kv = k.transpose(-2, -1) @ v  # (B, H, n, D, Dv): each chunk's K^T V
    state = kv.cumsum(dim=2) - kv  # exclusive prefix over chunks
    k_state = k.sum(dim=3, keepdim=True)  # (B, H, n, 1, D)
    k_state = k_state.cumsum(dim=2) - k_state
    scores = (q @ k.transpose(-2, -1)).tril()  # (B, H, n, C, C), causal inside the chunk
    num = scores @ v + q @ state
    den = scores.sum(-1, keepdim=True) + (q * k_state).sum(-1, keepdim=True)
    out = num / (den + eps)
    return out.reshape(B, H, n * chunk, -1)[:, :, :T]


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(
        self, n_embd: int, n_head: int, block_size: int, dropout: float, bias: bool, attention: AttentionKind
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout, bias, attention)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.ModuleDict):
    """nanoGPT's ``transformer`` container (``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``), with its entries typed.

    A plain ``nn.ModuleDict`` at runtime (same parameter names); the annotations only tell type checkers what each
    entry is, where ``nn.Module.__getattr__`` would say ``Tensor | Module``.
    """

    wte: nn.Embedding
    wpe: nn.Embedding
    drop: nn.Dropout
    h: nn.ModuleList
    ln_f: nn.LayerNorm


class GPT(VerifiedCheckpoints, LightningModule):
    """Decoder-only Transformer language model (nanoGPT layout, weight-tied output head).

    Args:
        vocab_size: number of tokens. ``None`` takes it from the datamodule (``trainer.datamodule.vocab_size``)
            when training starts; it is then saved in the hyper-parameters, so ``load_from_checkpoint`` works.
        n_layer: number of Transformer blocks (default 4).
        n_head: attention heads per block (default 4).
        n_embd: model width (default 128).
        block_size: context length (default 64).
        dropout: dropout probability (default 0.0).
        bias: biases in linear layers and LayerNorms (default ``True``).
        attention: ``"sdpa"`` (fused ``scaled_dot_product_attention``, default), ``"explicit"`` (unfused softmax
            attention) or ``"linear"`` (causal linear attention).
        learning_rate: peak AdamW learning rate (default 1e-3).
        weight_decay: AdamW decay of every matrix (the tied embedding/head included, as in nanoGPT); biases and
            norms get none (default 0.1).
        betas: AdamW betas (default ``(0.9, 0.99)``).
        warmup_steps: linear warm-up steps: the factor is ``(step + 1) / warmup_steps``, reaching 1 at the last
            warm-up step (:class:`~lightning_sdp.schedules.WarmupCosine`; default 100).
        min_lr_ratio: the cosine schedule ends at ``learning_rate * min_lr_ratio`` (default 0.1).
        max_steps: length of the cosine schedule; ``None`` uses the Trainer's estimated stepping batches.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        attention: AttentionKind = "sdpa",
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        max_steps: int | None = None,
    ) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}).")
        if attention not in ("sdpa", "explicit", "linear"):
            raise ValueError(f"attention must be 'sdpa', 'explicit' or 'linear', got {attention!r}.")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}.")
        self.save_hyperparameters()
        self.transformer: _Transformer | None = None
        self.lm_head: nn.Linear | None = None
        if vocab_size is not None:
            self._build(vocab_size)
        self._step_start: float | None = None

    # ----------------------------------------------------------------------------------------------- model
    @property
    def _hp(self) -> AttributeDict:
        """``self.hparams`` typed for attribute access (Lightning annotates it as a plain ``MutableMapping``)."""
        return cast(AttributeDict, self.hparams)

    def _build(self, vocab_size: int) -> None:
        hp = self._hp
        self.transformer = _Transformer(
            dict(
                wte=nn.Embedding(vocab_size, hp.n_embd),
                wpe=nn.Embedding(hp.block_size, hp.n_embd),
                drop=nn.Dropout(hp.dropout),
                h=nn.ModuleList(
                    Block(hp.n_embd, hp.n_head, hp.block_size, hp.dropout, hp.bias, hp.attention)
                    for _ in range(hp.n_layer)
                ),
                ln_f=nn.LayerNorm(hp.n_embd, bias=hp.bias),
            )
        )
        self.lm_head = nn.Linear(hp.n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf, 2017)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * hp.n_layer))
        hp.vocab_size = vocab_size

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.transformer is not None:
            return
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab_size = getattr(datamodule, "vocab_size", None)
        if vocab_size is None:
            raise ValueError(
                "GPT(vocab_size=None) takes the vocabulary size from the datamodule, but the Trainer has no "
                "datamodule with a `vocab_size` attribute. Pass vocab_size=... to GPT or use CharTextDataModule."
            )
        self._build(int(vocab_size))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``."""
        if self.transformer is None or self.lm_head is None:
            raise RuntimeError("GPT has no vocabulary size yet: pass vocab_size=... or fit it with a datamodule.")
        B, T = idx.shape
        if T > self._hp.block_size:
            raise ValueError(f"Sequence length {T} exceeds block_size {self._hp.block_size}.")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` (``(B, T)`` token ids)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self._hp.block_size :])[:, -1, :] / max(temperature, 1e-8)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), 1)), dim=1)
        return idx

    # -------------------------------------------------------------------------------------------- training
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            return
        elapsed = time.perf_counter() - self._step_start
        tokens = batch[0].numel() * self.trainer.world_size
        self.log("train/tokens_per_sec", tokens / max(elapsed, 1e-9), prog_bar=False)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        hp = self._hp
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
        )
        total = hp.max_steps
        if total is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 0
        schedule = WarmupCosine(hp.warmup_steps, max(total, 1), hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
