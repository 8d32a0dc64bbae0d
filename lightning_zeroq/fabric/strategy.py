"""``ZeroQFabricStrategy``: Fabric's calls in, the ZeRO engine out. Glue only, like ``lightning/strategy.py``
(the Trainer's twin); what the two share is in ``common/``.

Fabric leaves the training loop to the user, so each of its calls maps onto the engine directly:

- ``fabric.launch()``: DDP's launchers and process group (subprocess, torchrun, SLURM).
- ``fabric.init_module(empty_init=True)``: stage 3 builds on the meta device; the engine runs each
  module's ``reset_parameters()`` as it materializes the module's unit.
- ``fabric.setup(model, optimizer)``, or ``setup_module`` then ``setup_optimizers`` (LitGPT's order):
  build the engine (shard the model), then rebind the optimizer to this rank's master shards.
- ``fabric.no_backward_sync(model, enabled)``: ``enabled=True`` means "not the last micro-batch", so
  that backward does not end the (managed) accumulation window.
- ``fabric.backward(loss)``: the engine brackets the backward (fp16: of the scaled loss).
- ``fabric.clip_gradients(model, optimizer, max_norm=...)``: the global 2-norm across shards.
- ``optimizer.step()``: ``ZeroEngine.step`` (finalize, unscale and clip, step, publish).
- ``fabric.strategy.full_state_dict()``: collective, the full fp32 parameters by name.
- ``fabric.save`` / ``fabric.load``: the Trainer's checkpoint directory, sharded (``fabric/checkpoint.py``).

Accumulation, as configured by ``managed_gradient_accumulation``: managed, the user marks every
micro-batch but the last with ``no_backward_sync(model, enabled=True)`` (as for DDP), so stage 1
reduces only during the window's last backward; unmanaged, any number of ``fabric.backward`` calls
are followed by a step, and ``no_backward_sync`` changes nothing (the engine does the boundary work
inside the step).

One engine per strategy: set up one model (with any number of param groups in one optimizer).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Generator, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.types import _PATH, Optimizable
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zeroq.checkpoint.api import Allowance, Checkpointer, NameMap
from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.common.strategy import (
    PLAN_FORWARD_FIX,
    as_zeroq_precision,
    build_engine,
    check_one_optimizer,
    check_timeout,
    config_from_options,
    create_process_group,
    load_pretrained_option,
    local_checkpoint_path,
    pretrained_option,
    register_presets,
    stage3_meta_init,
)
from lightning_zeroq.common.watchdog import report_uncaught_collective_failures
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.fabric import checkpoint as fabric_checkpoint
from lightning_zeroq.validation import check_bool, check_callable
from lightning_zeroq.zero.engine import ZeroEngine

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import _LRScheduler


def _refuse_checkpoint_io(io: Any) -> None:
    if io is not None:
        raise ValueError(
            f"ZeroQFabricStrategy does not use a CheckpointIO plugin (got {type(io).__name__}): fabric.save and "
            "fabric.load write and read ZeroQ's checkpoint directories themselves. Remove checkpoint_io (or the "
            "plugin); to transform what is saved, change the state dict you pass to fabric.save."
        )


class ZeroQFabricPrecision(ZeroQPrecision):
    """ZeroQ's precision modes (``common/precision.py``: working dtype, fp32 masters, autocast, fp16 loss
    scaling) behind Fabric's calls.

    The Trainer's plugin takes the LightningModule in its backward hooks and runs its callbacks there;
    Fabric calls them with the loss alone and ignores what ``pre_backward`` returns, so the loss is
    scaled in ``backward``. Outputs come back in the default dtype, as from Fabric's own plugins.
    """

    @override
    def pre_backward(self, tensor: Tensor, module: Optional[nn.Module]) -> Tensor:
        return tensor

    @override
    def backward(self, tensor: Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self.loss_scaling:
            tensor = tensor * self._require_engine().loss_scale
        tensor.backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Optional[nn.Module]) -> Tensor:
        return tensor

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:  # type: ignore[override]
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise TypeError(
                f"optimizer.step() under ZeroQ takes at most a closure; got {sorted(kwargs)}. Set optimizer "
                "options in its param groups instead."
            )
        result = closure() if closure is not None else None
        self._require_engine().step()
        self.report_plan()
        return result

    @override
    def convert_output(self, data: Any) -> Any:
        if self.param_dtype == torch.float32:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())


class ZeroQBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: while ``enabled``, backward passes do not end the
    accumulation window (the strategy reads ``accumulating``)."""

    def __init__(self) -> None:
        self.module: Optional[nn.Module] = None
        self.accumulating = False

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if module is not self.module:
            raise TypeError(
                "fabric.no_backward_sync(model) needs the model set up by ZeroQFabricStrategy "
                f"(fabric.setup); got {type(module).__name__}, which this strategy did not set up."
            )
        return self._accumulate(bool(enabled))

    @contextlib.contextmanager
    def _accumulate(self, enabled: bool) -> Generator[None, None, None]:
        before, self.accumulating = self.accumulating, enabled
        try:
            yield
        finally:
            self.accumulating = before


class ZeroQFabricStrategy(DDPStrategy, _Sharded):
    """ZeRO stages 1, 2 and 3 (with INT8 weight sync and CPU/NVMe offload) as a Fabric strategy.

    Args:
        config: a ``ZeroConfig``; keyword ``options`` override its fields.
        **options: any ``ZeroConfig`` field, as for ``ZeroQStrategy`` (``stage``, ``offload_optimizer``,
            ``quantized_weights``, ``managed_gradient_accumulation``, ...).
        accelerator, parallel_devices, cluster_environment, precision, process_group_backend: as in
            Fabric's ``DDPStrategy``.
        timeout: the longest a collective waits, a positive ``timedelta`` or number of seconds.
        checkpoint_io: refused (``fabric.save`` / ``fabric.load`` write ZeroQ's directories themselves).
        plan_forward: needed with ``offload="auto"``, ``activation_checkpointing_policy="auto"`` or
            ``activation_offloading_policy="auto"``: a function of the model returning one micro-batch's loss
            (e.g. ``lambda m: loss_fn(m(x), y)`` with a sample batch), which the plan traces on the meta device
            before the model is sharded.
        exclude_frozen_parameters: ``fabric.save`` leaves out the frozen parameters (``requires_grad=False``),
            as Fabric's ``DeepSpeedStrategy`` does; ``fabric.load`` reads such a checkpoint into a model that
            holds the same frozen weights.
        pretrained: a checkpoint whose weights the model takes in ``fabric.setup`` right after the engine is
            built, each rank reading only its own part (as the Trainer's strategy; see ``load_pretrained``).
        pretrained_name_map, pretrained_allow_missing, pretrained_allow_unexpected: ``load_pretrained``'s
            ``name_map``, ``allow_missing`` and ``allow_unexpected`` for it (names of the set-up module).
    """

    def __init__(
        self,
        config: Optional[ZeroConfig] = None,
        *,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        plan_forward: Optional[Callable[[nn.Module], Tensor]] = None,
        exclude_frozen_parameters: bool = False,
        pretrained: Optional[_PATH] = None,
        pretrained_name_map: NameMap = None,
        pretrained_allow_missing: Allowance = None,
        pretrained_allow_unexpected: Allowance = None,
        **options: Any,
    ) -> None:
        self.config = config_from_options("ZeroQFabricStrategy", config, options)
        self.plan_forward = check_callable("ZeroQFabricStrategy", "plan_forward", plan_forward, PLAN_FORWARD_FIX)
        self.exclude_frozen_parameters = check_bool(
            "ZeroQFabricStrategy", "exclude_frozen_parameters", exclude_frozen_parameters
        )
        self._pretrained = pretrained_option(
            "ZeroQFabricStrategy",
            pretrained,
            pretrained_name_map,
            pretrained_allow_missing,
            pretrained_allow_unexpected,
        )
        _refuse_checkpoint_io(checkpoint_io)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=check_timeout("ZeroQFabricStrategy", timeout),
            start_method="popen",  # stage 3 state never travels between processes
        )
        self._backward_sync_control: ZeroQBackwardSyncControl = ZeroQBackwardSyncControl()
        self.engine: Optional[ZeroEngine] = None
        self.checkpointer = Checkpointer()

    # ------------------------------------------------------------------ the process group

    @override
    def _setup_distributed(self) -> None:
        create_process_group(self, super()._setup_distributed)  # as the Trainer's: a stalled or dead rank ends the job
        report_uncaught_collective_failures()  # Fabric has no on_exception: the hook reports what ends the script

    @property
    @override
    def checkpoint_io(self) -> Any:
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Any) -> None:  # Fabric(plugins=[MyCheckpointIO()]) sets it here
        _refuse_checkpoint_io(io)
        self._checkpoint_io = io

    # ------------------------------------------------------------------ precision

    @property
    @override
    def precision(self) -> ZeroQFabricPrecision:
        if self._precision is None:
            self._precision = ZeroQFabricPrecision()
        return self._precision  # type: ignore[return-value]

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = as_zeroq_precision(precision, ZeroQFabricPrecision)

    # ------------------------------------------------------------------ model and optimizer

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """Stages 1/2: as DDP (on the device; uninitialized with ``empty_init=True``). Stage 3 never holds
        the whole model on the device: with ``empty_init=True`` it is built on the meta device (the engine
        runs each module's ``reset_parameters()`` as it shards it, so load or re-initialize weights
        afterwards as with FSDP), otherwise on the default device, normally the host."""
        if self.config.stage != 3:
            return super().module_init_context(empty_init)
        stack = contextlib.ExitStack()
        if empty_init:
            stack.enter_context(self.module_sharded_context())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> contextlib.AbstractContextManager:
        return stage3_meta_init(self.config)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing here: ``setup_module`` hands the module to the engine, which places it unit by unit."""

    # DDPStrategy narrows the result to DistributedDataParallel; Strategy's (and Fabric's use) is any Module
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        """Shard ``module`` (its parameters become views into the engine's buffers); it is returned as is,
        without a wrapper."""
        if self.engine is not None:
            raise ValueError(
                "ZeroQFabricStrategy shards one model, and one is set up already; put the parts in one "
                "nn.Module, or use a second Fabric for a second model."
            )
        self.engine = build_engine(
            module,
            self.config,
            self.precision,
            self.root_device,
            ranks_per_node=self.num_processes,
            plan_forward=self.plan_forward,
            on_choice=self.precision.planned.append,
        )
        if self._pretrained is not None:
            load_pretrained_option(self._pretrained, self.engine, module)
        self.precision.attach_engine(self.engine, self.root_device.type)
        self._backward_sync_control.module = module
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Rebind ``optimizer`` (built from the set-up model's parameters) to this rank's master shards. The
        object is kept, so LR schedulers and code that sets ``param_groups[i]["lr"]`` keep working."""
        engine = self._require_engine("fabric.setup_optimizers(optimizer)")
        if engine.optimizer is not None and engine.optimizer is not optimizer:
            check_one_optimizer("ZeroQFabricStrategy", "one is set up already and this would make", 2)
        engine.attach_optimizer(optimizer)
        return optimizer

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional["_LRScheduler"] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional["_LRScheduler"]]:
        check_one_optimizer("ZeroQFabricStrategy", "fabric.setup() got", len(optimizers))
        # Materializing a meta-device module may replace its parameter objects; the optimizer was built
        # from the old ones, so follow them by name.
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        current = dict(module.named_parameters(remove_duplicate=False))
        for group in optimizers[0].param_groups:
            group["params"] = [current[names[id(p)]] if id(p) in names else p for p in group["params"]]
        return module, [self.setup_optimizer(optimizers[0])], scheduler

    # ------------------------------------------------------------------ backward, clipping

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        engine = self._require_engine("fabric.backward(loss)")
        boundary = None  # unmanaged: the step, whenever it comes, ends the window
        if self.config.managed_gradient_accumulation:
            boundary = not self._backward_sync_control.accumulating
        engine.pre_backward(boundary)
        super().backward(tensor, module, *args, **kwargs)
        engine.post_backward()

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global 2-norm of the gradient shards of all ranks; returns that norm (before
        clipping). Non-finite gradients are found before any clipping and handled as
        ``ZeroConfig.nonfinite_gradients`` says (an error naming step, ranks and parameters, or a
        skipped step; with fp16 loss scaling an overflow skips the step and lowers the scale), so
        ``error_if_nonfinite`` has nothing left to decide."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"ZeroQFabricStrategy clips by the global 2-norm across shards; norm_type={norm_type!r} is not "
                "supported. Use norm_type=2.0 (the default)."
            )
        return self._require_engine("fabric.clip_gradients(...)").clip_grad_norm_(float(max_norm))

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self._require_engine("fabric.clip_gradients(...)").clip_grad_value_(float(clip_val))

    # ------------------------------------------------------------------ state

    def full_state_dict(self) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name on every rank (frozen ones included)."""
        return self._require_engine("fabric.strategy.full_state_dict()").full_state_dict()

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Collective: a checkpoint directory (the Trainer's format, loadable at another world size or
        stage). ``state`` holds the model and optimizer from ``fabric.setup`` and any plain values or
        objects with ``state_dict()``; ``filter`` is not supported (the model is saved whole, but for its frozen
        parameters with ``exclude_frozen_parameters``)."""
        if storage_options is not None:
            raise TypeError(
                f"ZeroQFabricStrategy.save_checkpoint does not take storage_options (got "
                f"{storage_options!r}); it writes a torch.distributed.checkpoint directory."
            )
        path = local_checkpoint_path(self.broadcast(str(path)))
        fabric_checkpoint.save(
            self.engine, path, state, filter, self.checkpointer, exclude_frozen=self.exclude_frozen_parameters
        )

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Collective: validate on every rank, read this rank's part into the engine, fill ``state``'s
        other entries in place and return the rest of the checkpoint's entries."""
        return fabric_checkpoint.load(
            self.engine, local_checkpoint_path(path), state, strict, weights_only, self.checkpointer
        )

    @override
    def teardown(self) -> None:
        # As the Trainer's strategy: the module is handed back as a plain module with the trained
        # parameters; the engine keeps its shards for full_state_dict() and checkpoints.
        if self.engine is not None:
            precision = self.precision
            self.engine.release_module(dtype=precision.param_dtype if precision.precision.endswith("-true") else None)
        self.checkpointer.release()  # frees the pinned staging memory of saves (a later save allocates it again)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)

    def _require_engine(self, call: str) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError(
                f"{call} needs the model set up first: fabric.setup(model, optimizer), or model = "
                "fabric.setup(model) followed by fabric.setup_optimizers(optimizer)."
            )
        return self.engine
