"""SDP4Bit: 4-bit weight and gradient communication for sharded data parallelism (Jia et al., NeurIPS 2024).

``Trainer(strategy="sdp4bit")`` or ``Trainer(strategy=SDP4BitStrategy(...))``; see ``docs/sdp4bit.md``.

Modules: ``strategy`` (the Lightning strategy), ``config`` (its options, checked once), ``formats`` (what travels
on the wire), ``exchange`` (the quantised collectives), ``overlap`` (the worker threads, the backward hooks that
launch the gradient exchanges and the forward prefetch of the weights), ``sharding`` (flat buckets, optimizer
sharding, checkpoint consolidation), ``topology`` (intra/inter-node process groups), ``precision`` (clipping on the
shards). The names below are loaded lazily so that the collectives can be used (and tested) without importing
Lightning.
"""

from lightning_sdp._lazy import lazy_exports

_EXPORTS = {
    "SDP4BitStrategy": "lightning_sdp.plugins.sdp4bit.strategy",
    "grad_norm": "lightning_sdp.plugins.sdp4bit.norms",
    "SDP4BitConfig": "lightning_sdp.plugins.sdp4bit.config",
    "WeightFormat": "lightning_sdp.plugins.sdp4bit.formats",
    "GradientFormat": "lightning_sdp.plugins.sdp4bit.formats",
    "CommStats": "lightning_sdp.plugins.sdp4bit.exchange",
    "Topology": "lightning_sdp.plugins.sdp4bit.topology",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
