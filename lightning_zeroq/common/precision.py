"""Precision owned by the ZeroQ strategy, the way ``DeepSpeedStrategy`` owns it.

| precision    | working parameters | master shards | forward                      |
|--------------|--------------------|---------------|------------------------------|
| ``32-true``  | fp32               | fp32          | as written                   |
| ``bf16-mixed`` | bf16             | fp32          | autocast to bf16             |
| ``16-mixed`` | fp16               | fp32          | autocast to fp16, dynamic loss scaling |
| ``bf16-true`` | bf16 (buffers too) | fp32         | inputs and default dtype bf16 |

``bf16-true`` keeps fp32 master shards, a documented deviation from Lightning's plain ``bf16-true``:
the master copy is sharded, so it costs 4/N bytes per parameter, and it keeps updates exact.

The optimizer step goes through the engine: the closure runs the backward passes, the engine
finalizes the gradient shards (and decides fp16 overflow on every rank alike), Lightning's hooks and
clipping run (clipping by the global norm across shards), then the engine steps.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_zeroq.planning.choose import Choice, report_first_step

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_zeroq.zero.engine import ZeroEngine

PARAM_DTYPES = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


class ZeroQPrecision(Precision):
    """Precision plugin for ``ZeroQStrategy``; see the module docstring for the modes."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PARAM_DTYPES:
            raise ValueError(
                f"ZeroQStrategy does not support precision={precision!r}; use one of {list(PARAM_DTYPES)} "
                "(for example precision='bf16-mixed')."
            )
        self.precision = precision  # type: ignore[assignment]
        self.param_dtype = PARAM_DTYPES[precision]
        self.engine: Optional["ZeroEngine"] = None
        self.device_type = "cpu"
        self.planned: list[Choice] = []
        """``offload="auto"``'s choice, until the first step's measured peak is logged beside it."""

    def attach_engine(self, engine: Optional["ZeroEngine"], device_type: str) -> None:
        """The strategy hands over the engine it built (and the device type autocast runs on)."""
        self.engine, self.device_type = engine, device_type

    @property
    def loss_scaling(self) -> bool:
        return self.precision == "16-mixed"

    @property
    def _true_half(self) -> bool:
        return self.precision.endswith("-true") and self.param_dtype != torch.float32

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast what the engine does not own: frozen parameters and buffers (``*-true`` only)."""
        if self._true_half:
            frozen = self.engine.parts.frozen if self.engine is not None else None
            sharded = {id(p) for part in frozen.units for p in part.params} if frozen is not None else set()
            with torch.no_grad():
                for p in module.parameters():  # (stage 3's sharded ones were cast before the engine took them)
                    if not p.requires_grad and p.is_floating_point() and id(p) not in sharded:
                        p.data = p.data.to(self.param_dtype)
                for b in module.buffers():
                    if b.is_floating_point():
                        b.data = b.data.to(self.param_dtype)
        return module

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """``*-true`` half precisions create tensors in that dtype (``Trainer.init_module``), as
        Lightning's ``HalfPrecision`` does; the engine keeps fp32 masters of them anyway."""
        return _DtypeContextManager(self.param_dtype) if self._true_half else contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        state["engine"] = None  # the strategy pickles without its engine too
        return state

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=self.param_dtype)
        if self._true_half:
            return _DtypeContextManager(self.param_dtype)
        return contextlib.nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        if self._true_half:
            return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.param_dtype)
        return data

    @override
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)
        if self.loss_scaling and self.engine is not None:
            tensor = tensor * self.engine.loss_scale
        return tensor

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        engine = self._require_engine()
        closure_result = closure()
        if isinstance(_unwrapped(optimizer), _MockOptimizer):
            # configure_optimizers returned None: Lightning fits without an optimizer, as DDP does. Forward,
            # backward and the hooks run; no step, and the window's gradients are dropped.
            self._after_closure(model, optimizer)
            engine.zero_grad()
            return closure_result
        if closure_result is None and model.automatic_optimization and not engine.has_gradients:
            # training_step returned None on every micro-batch of the window: nothing to step. If earlier
            # micro-batches ran backward, step with what they accumulated, as DDP does.
            return closure_result
        self._after_closure(model, optimizer)
        engine.step(_unwrapped(optimizer))
        self.report_plan()
        return closure_result

    def report_plan(self) -> None:
        """After the first step: the measured peak beside ``offload="auto"``'s plan (``planning/choose.py``)."""
        if self.planned and self.engine is not None:
            report_first_step(self.planned.pop(), self.engine.parts.device)

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if isinstance(_unwrapped(optimizer), _MockOptimizer):
            return  # no optimizer: its gradients are dropped, nothing to clip
        self._require_engine().clip_grad_norm_(float(clip_val), _unwrapped(optimizer))

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        if isinstance(_unwrapped(optimizer), _MockOptimizer):
            return
        self._require_engine().clip_grad_value_(float(clip_val), _unwrapped(optimizer))

    def _require_engine(self) -> "ZeroEngine":
        if self.engine is None:
            raise RuntimeError("ZeroQPrecision has no engine: it is only usable inside ZeroQStrategy during fit.")
        return self.engine


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer behind a ``LightningOptimizer`` (``clip_gradients`` passes the wrapper)."""
    return getattr(optimizer, "optimizer", optimizer)
