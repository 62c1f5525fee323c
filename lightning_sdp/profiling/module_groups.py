"""Module groups of EngineProfiler's per-module view: attention, MLP, norms, embeddings, head, loss, optimizer.

The callback opens a ``record_function`` scope named ``module::<path>`` around every module's forward
(:data:`MODULE_SCOPE_PREFIX`); :func:`module_group` maps such a path to its group from the module's class name and
the path's components, and :func:`is_loss_op` recognises loss operators run outside any module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Module groups of the per-module view.
MODULE_GROUPS: tuple[str, ...] = (
    "attention",
    "mlp",
    "norm",
    "embedding",
    "head",
    "loss",
    "optimizer",
    "other",
)

MODULE_SCOPE_PREFIX = "module::"
"""Name prefix of the per-module ``record_function`` scopes."""

_MLP_NAMES = {
    "ff",
    "fc",
    "fc1",
    "fc2",
    "c_fc",
    "feed_forward",
    "feedforward",
    "linear1",
    "linear2",
    "intermediate",
    "up_proj",
    "down_proj",
    "gate_proj",
    "dense_h_to_4h",
    "dense_4h_to_h",
    "w1",
    "w2",
    "w3",
}

_LOSS_OPS = re.compile(
    r"(cross_entropy|nll_loss|log_softmax|_log_softmax|mse_loss|l1_loss|binary_cross_entropy|"
    r"smooth_l1|kl_div|ctc_loss|huber_loss)"
)


def is_loss_op(base_name: str) -> bool:
    """True for loss operators (cross entropy, NLL, MSE, ...) given an operator's base name (``"nll_loss"``)."""
    return bool(_LOSS_OPS.search(base_name))


def module_group(path: str, module_types: Mapping[str, str] | None = None) -> str:
    """Group of a module path for the per-module view.

    The module's own type decides first (``LayerNorm`` -> ``norm``, ``Embedding`` -> ``embedding``,
    ``MultiheadAttention`` -> ``attention``, loss modules -> ``loss``); otherwise the path components are read from
    the innermost outwards for keywords (``attn``, ``mlp``/``ffn``, ``ln``/``norm``, ``wte``/``emb``,
    ``head``).

    Args:
        path: dotted module path, e.g. ``"transformer.h.0.attn.c_proj"``.
        module_types: map ``path -> class name`` of the model's modules.
    """
    types = module_types or {}
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        sub = ".".join(parts[:i])
        tname = types.get(sub, "").lower()
        if tname:
            if "norm" in tname:
                return "norm"
            if "embedding" in tname:
                return "embedding"
            if "attention" in tname:
                return "attention"
            if tname.endswith("loss"):
                return "loss"
            if tname in ("mlp", "feedforward", "ffn"):
                return "mlp"
        comp = parts[i - 1].lower()
        if "attn" in comp or "attention" in comp:
            return "attention"
        if comp in _MLP_NAMES or "mlp" in comp or "ffn" in comp:
            return "mlp"
        if comp.startswith("ln") or "norm" in comp:
            return "norm"
        if comp in ("wte", "wpe", "tok_emb", "pos_emb") or "emb" in comp:
            return "embedding"
        if "head" in comp or comp in ("classifier", "output", "out_proj_vocab"):
            return "head"
        if "loss" in comp or "criterion" in comp:
            return "loss"
    return "other"
