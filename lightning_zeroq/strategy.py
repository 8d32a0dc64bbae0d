"""``ZeroQStrategy``: Lightning's lifecycle in, the ZeRO engine out. Glue only; no sharding math here.

Lifecycle:
- ``__init__`` validates a ``ZeroConfig`` (keyword names as in Lightning's ``DeepSpeedStrategy``).
- ``setup_environment`` (inherited from DDP): process group (NCCL on GPU, gloo on CPU), seeds.
- ``setup``: move the module to the device; when fitting, build the engine once (it shards the
  trainable parameters), call ``configure_optimizers`` and rebind the optimizer to the master shards.
  ``setup`` runs again for every ``fit``/``validate``/``test``, so it reuses an existing engine.
- backward: ``pre_backward`` tells the engine whether this backward ends a managed accumulation
  window (so stage 1 reduces during it); ``post_backward`` closes it.
- step: ``ZeroQPrecision.optimizer_step`` drives the engine (finalize, hooks and clipping, step).
- checkpoints: a ``torch.distributed.checkpoint`` directory in which every parameter and optimizer
  state tensor is stored by name at its full shape, each rank writing its own chunks, plus a JSON
  manifest with the trainer state; loadable at any world size, stage or layout, by FSDP2, and
  offline (``lightning_zeroq/checkpoint/``, ``zeroq-convert``).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Generator, Mapping, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zeroq.checkpoint import atomic
from lightning_zeroq.checkpoint import lightning as checkpoint_glue
from lightning_zeroq.checkpoint.checkpointer import Checkpointer
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.precision import ZeroQPrecision
from lightning_zeroq.zero import state_dict as zero_state
from lightning_zeroq.zero.engine import ZeroEngine

checkpoint_glue.install_load_from_checkpoint()

PRESETS: dict[str, dict[str, Any]] = {
    "zeroq": {},
    "zeroq_stage_1": {"stage": 1},
    "zeroq_stage_2": {"stage": 2},
    "zeroq_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "zeroq_stage_3": {"stage": 3},
    "zeroq_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}


class ZeroQStrategy(DDPStrategy):
    """ZeRO stages 1, 2 and 3 (with INT8 weight sync and CPU/NVMe offload) as a Lightning strategy.

    Args:
        config: a ``ZeroConfig``; keyword ``options`` override its fields.
        **options: any ``ZeroConfig`` field: ``stage``, ``reduce_bucket_size``, ``allgather_bucket_size``,
            ``overlap_comm``, ``managed_gradient_accumulation``, ``offload_optimizer``,
            ``offload_optimizer_device``, ``offload_parameters``, ``offload_params_device``,
            ``nvme_path``, ``quantized_weights``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
        async_checkpoint: save checkpoints with ``torch.distributed.checkpoint.async_save``: training
            waits only while the state is copied to host memory, the files are written in the
            background (the next save, a load or ``wait_for_checkpoint()`` waits for them).
    """

    strategy_name = "zeroq"

    def __init__(
        self,
        config: Optional[ZeroConfig] = None,
        *,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        async_checkpoint: bool = False,
        **options: Any,
    ) -> None:
        known = {f for f in ZeroConfig.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"ZeroQStrategy got unknown option(s) {unknown}; valid options are {sorted(known)}."
            )
        self.config = (config or ZeroConfig()).replace(**options)
        if start_method != "popen" and self.config.stage == 3:
            raise ValueError(
                f"ZeroQStrategy(stage=3, start_method={start_method!r}): the {start_method} launcher sends rank "
                "0's whole state_dict back to the main process, which stage 3 never holds; use "
                "start_method='popen' (the default) or torchrun."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.engine: Optional[ZeroEngine] = None
        self.checkpointer = Checkpointer(async_save=async_checkpoint)
        self._weights_loaded = False

    # ------------------------------------------------------------------ Lightning contract

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # Lightning decides when to step; the engine accumulates across backward passes itself.
        return False

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> ZeroQPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroQPrecision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is not None and not isinstance(plugin, ZeroQPrecision):
            plugin = ZeroQPrecision(str(plugin.precision))
        self._precision_plugin = plugin

    @override
    def setup(self, trainer: "Any") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        plugin = self.precision_plugin
        if self.engine is None:
            # The engine moves the module to the device unit by unit (stage 3 never holds it whole)
            # and starts every rank from rank 0's values, as DDP does.
            self.engine = ZeroEngine(
                module,
                self.config,
                param_dtype=plugin.param_dtype,
                loss_scaling=plugin.loss_scaling,
                device=self.root_device,
            )
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"ZeroQStrategy supports exactly one optimizer, configure_optimizers returned "
                    f"{len(self.optimizers)}; put all parameters in one optimizer with several param groups."
                )
            self.engine.attach_optimizer(self.optimizers[0])
        plugin.attach_engine(self.engine, self.root_device.type)
        plugin.convert_module(module)
        self.setup_precision_plugin()

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.engine is None:
            return
        module, trainer = self.lightning_module, self.lightning_module.trainer
        boundary = None
        if module.automatic_optimization and trainer.training:
            boundary = not trainer.fit_loop._should_accumulate()
        self.engine.pre_backward(boundary)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.post_backward()

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # The engine defers or overlaps reductions itself; there is no DDP reducer to silence.
        yield

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: modules created here (``configure_model``) live on the meta device until the
        engine materializes them unit by unit with ``reset_parameters()``, so a model larger than one
        device can be built."""
        if self.config.stage == 3:
            with torch.device("meta"):
                yield
        else:
            yield

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        if self.config.stage == 3:  # Trainer.init_module(): never materialize the whole model
            with torch.device("meta"):
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    @override
    def teardown(self) -> None:
        # Unlike DDP, keep the module where it is: its parameters are views into the engine's buffers,
        # and full_state_dict() must keep working after fit returns. NVMe swap files are removed.
        if self.engine is not None:
            self.engine.release_swap_files()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ state

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name (frozen ones included) on every rank, or with
        ``rank0_only`` on rank 0 only (gathered unit by unit; other ranks get ``{}``)."""
        if self.engine is not None:
            return zero_state.full_state_dict(self.engine, rank0_only=rank0_only)
        if rank0_only and not self.is_global_zero:
            return {}
        return {n: p.detach().float().cpu().clone() for n, p in self.lightning_module.named_parameters(remove_duplicate=False)}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part: every parameter as chunks of the fp32 masters at full shape (read when the
        checkpoint is written, nothing is gathered), frozen parameters and buffers as they are."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        return zero_state.sharded_model_state(self.engine)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: this rank's part of the optimizer state, keyed by parameter name."""
        if self.engine is None or self.engine.optimizer is None:
            return super().optimizer_state(optimizer)
        return zero_state.sharded_optimizer_state(self.engine)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """A checkpoint directory (see ``lightning_zeroq/checkpoint``); weights-only checkpoints are one
        consolidated file. ``checkpoint`` itself is never changed."""
        if storage_options is not None:
            raise TypeError(
                f"ZeroQStrategy.save_checkpoint does not take storage_options (got {storage_options!r}); "
                "it writes a torch.distributed.checkpoint directory."
            )
        path = Path(self.broadcast(str(filepath))).absolute()
        checkpoint_glue.save(self, checkpoint, path, self.checkpointer)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is complete (raises its error, if any)."""
        self.checkpointer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Validates the checkpoint on every rank, then reads this rank's part (any world size, stage or
        layout; a directory from FSDP2; a single Lightning file, e.g. from ``strategy="ddp"``).
        ``weights_only=False`` is honored only for single files you trust; directories never need it."""
        state, self._weights_loaded = checkpoint_glue.load(self, checkpoint_path, weights_only, self.checkpointer)
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._weights_loaded or "state_dict" not in checkpoint:
            self._weights_loaded = False  # load_checkpoint read them into the shards already
            return
        state = checkpoint["state_dict"]
        if self.engine is None:
            self.lightning_module.load_state_dict(state, strict=strict)
            return
        managed = self.engine.load_full_state_dict(state)
        rest = {k: v for k, v in state.items() if k not in managed}
        missing, unexpected = self.lightning_module.load_state_dict(rest, strict=False)
        missing = [k for k in missing if k not in managed]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error loading the checkpoint's state_dict: missing keys {missing}, unexpected keys "
                f"{unexpected}. Pass strict_loading=False to the LightningModule to ignore them."
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint read the optimizer state into the shards

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes a checkpoint directory or file (a link: the link, never its target), after
        an asynchronous save to the same path is complete."""
        path = Path(filepath).absolute()
        if self.checkpointer.pending_path() == path:
            self.checkpointer.wait()
        if self.is_global_zero:
            atomic.remove(path)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, options in PRESETS.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=f"ZeroQ with {options or 'defaults (stage 2)'}", **options)

