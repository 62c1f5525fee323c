"""Gradient clipping on SDP4Bit's reduced gradient shards, as a precision plugin that wraps the user's one.

Lightning clips through the precision plugin (``trainer.gradient_clip_val`` and ``LightningModule.clip_gradients``
both end in ``precision_plugin.clip_grad_by_norm`` / ``clip_grad_by_value``). Under :class:`SDP4BitStrategy` the
gradients the optimizer steps are flat fp32 shards, one per rank, so clipping must see the global norm of all
shards. :class:`ShardedClippingPrecision` wraps whatever precision plugin the Trainer chose, forwards every call to
it, and hands the two clipping calls to the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

ClipKind = Literal["norm", "value"]
# Clips ``optimizer``'s reduced shards and returns ``True``, or returns ``False`` when it does not shard it.
ShardClipper = Callable[[Any, ClipKind, float], bool]


class ShardedClippingPrecision(Precision):
    """Forwards everything to ``plugin`` except gradient clipping, which goes to ``clip_shards`` first.

    Args:
        plugin: the precision plugin to wrap (``32-true``, ``bf16-mixed``, ...).
        clip_shards: clips the reduced gradient shards of an optimizer the strategy shards and returns ``True``,
            or returns ``False`` for an optimizer it does not shard (then ``plugin`` clips as usual).
    """

    def __init__(self, plugin: Precision, clip_shards: ShardClipper) -> None:
        if isinstance(plugin, ShardedClippingPrecision):
            raise TypeError("ShardedClippingPrecision must not wrap itself; wrap the user's precision plugin once.")
        self.plugin = plugin
        self._clip_shards = clip_shards

    @property
    def precision(self) -> Any:  # type: ignore[override]  # a class attribute on Precision
        """The wrapped plugin's precision (``trainer.precision`` reads it)."""
        return self.plugin.precision

    def __getattr__(self, name: str) -> Any:
        # attributes only the wrapped plugin has (``scaler``, ``device``, ``autocast_context_manager``, ...)
        if name == "plugin":  # not set yet (unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.plugin, name)

    # ------------------------------------------------------------------------------------------------ clipping

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not self._clip_shards(optimizer, "norm", float(clip_val)):
            self.plugin.clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not self._clip_shards(optimizer, "value", float(clip_val)):
            self.plugin.clip_grad_by_value(optimizer, clip_val)

    # ``clip_gradients`` is inherited: it checks ``clip_val`` and calls the two methods above on this wrapper.

    # ------------------------------------------------------------------------------------------------ forwarded

    @override
    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        return self.plugin.connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: Module) -> Module:
        return self.plugin.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self.plugin.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.plugin.convert_output(data)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.plugin.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.plugin.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.plugin.forward_context()

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self.plugin.train_step_context():
            yield

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self.plugin.val_step_context():
            yield

    @override
    @contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self.plugin.test_step_context():
            yield

    @override
    @contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.plugin.predict_step_context():
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Any:
        return self.plugin.pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.plugin.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        return self.plugin.post_backward(tensor, module)

    @override
    # ignore[override]: Lightning's own pytorch Precision.optimizer_step (this signature) already breaks fabric's
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # the wrapped plugin runs its own closure wrapper; its ``configure_gradient_clipping`` call reaches
        # ``trainer.precision_plugin.clip_gradients``, which is this wrapper
        return self.plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        return self.plugin.main_params(optimizer)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.plugin.unscale_gradients(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.plugin.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.plugin.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.plugin.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.plugin.on_load_checkpoint(checkpoint)

    @override
    def teardown(self) -> None:
        self.plugin.teardown()
