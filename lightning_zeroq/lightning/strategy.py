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
- weight averaging (``EMAWeightAveraging``, ``StochasticWeightAveraging``): hooks run with the parameters
  gathered where the module does not hold the fp32 masters between steps, their checkpoint loads in every
  stage (``averaging.py``).
- checkpoints: a ``torch.distributed.checkpoint`` directory in which every parameter and optimizer
  state tensor is stored by name at its full shape, each rank writing its own chunks, plus a JSON
  manifest with the trainer state; loadable at any world size, stage or layout, by FSDP2, and
  offline (``lightning_zeroq/checkpoint/``, ``zeroq-convert``).
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_zeroq.checkpoint import api as checkpoint_api
from lightning_zeroq.checkpoint.api import Allowance, Checkpointer, NameMap
from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.common.strategy import (
    PLAN_FORWARD_FIX,
    as_zeroq_precision,
    build_engine,
    check_timeout,
    config_from_options,
    create_process_group,
    load_pretrained_option,
    local_checkpoint_path,
    pretrained_option,
    register_presets,
    stage3_meta_init,
)
from lightning_zeroq.common.watchdog import report_collective_failure
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.lightning import checkpoint as checkpoint_glue
from lightning_zeroq.lightning.averaging import gather_around_averaging, refuse_meta_copies
from lightning_zeroq.lightning.launcher import ZeroQLauncher, record_sigterm_without_collectives
from lightning_zeroq.lightning.plan_batch import planning_forward
from lightning_zeroq.nulls import nothing
from lightning_zeroq.validation import check_bool, check_callable
from lightning_zeroq.zero import full_params
from lightning_zeroq.zero import state_dict as zero_state
from lightning_zeroq.zero.engine import ZeroEngine
from lightning_zeroq.zero.full_params import check_module

checkpoint_glue.install_load_from_checkpoint()


class ZeroQStrategy(DDPStrategy):
    """ZeRO stages 1, 2 and 3 (with INT8 weight sync and CPU/NVMe offload) as a Lightning strategy.

    Args:
        config: a ``ZeroConfig``; keyword ``options`` override its fields.
        **options: any ``ZeroConfig`` field: ``stage``, ``reduce_bucket_size``, ``allgather_bucket_size``,
            ``overlap_comm``, ``managed_gradient_accumulation``, ``offload_optimizer``,
            ``offload_optimizer_device``, ``offload_optimizer_ratio``, ``offload_parameters``,
            ``offload_params_device``,
            ``nvme_path``, ``quantized_weights``, ``shard_group_size`` (``"node"``: the processes of
            one node, ``devices``), ``quantize_cross_group_only``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, start_method: as in Lightning's ``DDPStrategy``.
        timeout: the longest a collective waits, a positive ``timedelta`` or number of seconds.
        plan_forward: with ``offload="auto"``, ``activation_checkpointing_policy="auto"`` or
            ``activation_offloading_policy="auto"``: a function of the model returning one micro-batch's loss,
            which the plan traces on the meta device (default: the module's ``training_step`` on the first batch
            of its training dataloader).
        async_checkpoint: save checkpoints with ``torch.distributed.checkpoint.async_save``: training
            waits only while the state is copied to host memory, the files are written in the
            background (the next save, a load or ``wait_for_checkpoint()`` waits for them).
        exclude_frozen_parameters: checkpoint directories leave out the frozen parameters
            (``requires_grad=False``: a LoRA base), as with Lightning's ``DeepSpeedStrategy``; they hold the
            trainable parameters, their optimizer state and the trainer state. ``fit(ckpt_path=...)`` resumes
            them onto a model that holds the same frozen weights (the manifest names the ones left out).
        pretrained: a checkpoint whose weights the module takes right after the engine is built, in
            ``setup`` (before ``on_fit_start`` and the first step), each rank reading only its own part: a
            Hugging Face safetensors checkpoint, a ``torch.save`` state dict (LitGPT's ``lit_model.pth``) or a
            ``torch.distributed.checkpoint`` directory. Loaded once per strategy: a later ``fit`` keeps the
            trained weights, and ``fit(ckpt_path=...)`` then replaces them with the checkpoint's.
        pretrained_name_map, pretrained_allow_missing, pretrained_allow_unexpected: ``load_pretrained``'s
            ``name_map``, ``allow_missing`` and ``allow_unexpected`` for it; names are the LightningModule's
            (``{"model.": ""}`` where it holds the model as ``self.model``).
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
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        start_method: str = "popen",
        async_checkpoint: bool = False,
        exclude_frozen_parameters: bool = False,
        plan_forward: Optional[Callable[[torch.nn.Module], Tensor]] = None,
        pretrained: Optional[_PATH] = None,
        pretrained_name_map: NameMap = None,
        pretrained_allow_missing: Allowance = None,
        pretrained_allow_unexpected: Allowance = None,
        **options: Any,
    ) -> None:
        self.config = config_from_options("ZeroQStrategy", config, options)
        self.plan_forward = check_callable("ZeroQStrategy", "plan_forward", plan_forward, PLAN_FORWARD_FIX)
        self._pretrained = pretrained_option(
            "ZeroQStrategy", pretrained, pretrained_name_map, pretrained_allow_missing, pretrained_allow_unexpected
        )
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
            timeout=check_timeout("ZeroQStrategy", timeout),
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.engine: Optional[ZeroEngine] = None
        self._unwrap_averaging: Callable[[], None] = nothing  # see averaging.py
        self.checkpointer = Checkpointer(async_save=check_bool("ZeroQStrategy", "async_checkpoint", async_checkpoint))
        self.exclude_frozen_parameters = check_bool(
            "ZeroQStrategy", "exclude_frozen_parameters", exclude_frozen_parameters
        )
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

    @property
    @override
    def precision_plugin(self) -> ZeroQPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroQPrecision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = as_zeroq_precision(plugin, ZeroQPrecision)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:  # the ranks it kills leave no swap directory
            self._launcher = ZeroQLauncher(
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                functools.partial(_swap_roots, self.config.nvme_path),
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        trainer: Any = module._trainer if module is not None else None
        if module is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            refuse_meta_copies(trainer.callbacks, module)  # before the callbacks' setup copies the model

    @override
    def setup_distributed(self) -> None:
        create_process_group(self, super().setup_distributed)

    @override
    def setup(self, trainer: "Any") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        plugin = self.precision_plugin
        module = self.lightning_module
        assert module is not None and self.model is not None  # the Trainer connected the module before setup
        self._failed = False
        # After a fit the module is plain again; the fit's engine keeps its state for save_checkpoint.
        if self.engine is None or (self.engine.parts.retired and fitting):
            if self.engine is not None:
                self.engine.close()  # the previous fit's engine: its state goes (NVMe files included)
            if fitting and self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            plugin.convert_module(module)  # frozen parameters in the run's dtype before stage 3 shards them
            forward = self.plan_forward or planning_forward(trainer, module, plugin, self.config, self.root_device)
            self.engine = build_engine(
                module,
                self.config,
                plugin,
                self.root_device,
                ranks_per_node=self.num_processes,
                plan_forward=forward,
                on_choice=plugin.planned.append,
                training=fitting,
            )
            if self._pretrained is not None:  # once: a later engine is built from the weights the module took
                load_pretrained_option(self._pretrained, self.engine, module)
                self._pretrained = None
        if self.engine.parts.retired:
            self.precision_plugin.attach_engine(None, self.root_device.type)
            self.setup_precision_plugin()
            return
        if fitting:
            self.setup_optimizers(trainer)
            if not self.optimizers:
                raise ValueError("ZeroQStrategy needs an optimizer: configure_optimizers returned none.")
            # configure_optimizers returned None: Lightning's stand-in steps nothing (it warns), as with DDP
            optimizers = [o for o in self.optimizers if not isinstance(o, _MockOptimizer)]
            _check_disjoint(optimizers)
            self.engine.parts.host_memory.accumulates = (
                trainer.accumulate_grad_batches > 1 or not module.automatic_optimization
            )
            for optimizer in optimizers:  # several (manual optimization) must hold disjoint parameters
                self.engine.attach_optimizer(optimizer)
            self.optimizers = self.optimizers  # wrap again: the wrappers subclass the optimizers' (new) classes
            # Weight averages read and write the fp32 masters (their loop hooks gathered where the module does
            # not hold them); what their checkpoint load writes into the module the masters take, in every stage.
            self._unwrap_averaging()
            self._unwrap_averaging = gather_around_averaging(
                trainer.callbacks,
                functools.partial(self.gathered_parameters, writeback=True),
                loop_hooks=not full_params.module_holds_masters(self.engine.parts),
            )
        plugin.attach_engine(self.engine, self.root_device.type)
        plugin.convert_module(module)
        self.setup_precision_plugin()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None  # training has started
        record_sigterm_without_collectives(self.lightning_module.trainer)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.engine is None:
            return
        module = self.lightning_module
        assert module is not None  # an engine exists only for a connected module
        trainer = module.trainer
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
        """Stage 3: parameters created here (``configure_model``) live on the meta device until the
        engine materializes them unit by unit with their module's ``reset_parameters()``, so a model
        larger than one device can be built. Buffers and other state (metrics) are created normally."""
        with stage3_meta_init(self.config):
            yield

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        if self.config.stage == 3:  # Trainer.init_module(): never materialize the whole model
            with stage3_meta_init(self.config), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    def gathered_parameters(
        self, module: Optional[torch.nn.Module] = None, writeback: bool = False
    ) -> contextlib.AbstractContextManager:
        """Collective context manager (every rank enters it): inside, the parameters of ``module``
        (default: the LightningModule) are plain tensors with their full fp32 values, also in stage 3;
        ``writeback=True`` keeps what the block changed. Like FSDP's ``summon_full_params`` and
        DeepSpeed's ``GatheredParameters``."""
        check_module("ZeroQStrategy.gathered_parameters", module, optional=True)
        if self.engine is None or self.engine.parts.retired:
            return contextlib.nullcontext()  # the module holds plain, full parameters
        return self.engine.gathered_parameters(module, writeback)

    @override
    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """Collective: every trainable parameter's gradient norm and their total, keyed as Lightning's
        ``grad_norm`` utility keys them, for ``on_before_optimizer_step`` (where ``.grad`` is empty:
        gradients live in shards). Before clipping, after fp16 unscaling, as DDP's ``.grad`` there."""
        if self.engine is None or self.engine.parts.retired:
            raise RuntimeError(
                "grad_norms() is for the training step (on_before_optimizer_step): no engine is training."
            )
        return self.engine.grad_norms(norm_type)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # other ranks may be anywhere: teardown must not start a collective
        report_collective_failure(exception)

    @override
    def teardown(self) -> None:
        # Unlike DDP, the module is not moved: the engine hands it back as a plain module (hooks
        # removed, full trained parameters as ordinary tensors), so a second fit, another strategy or
        # plain PyTorch can use it; the engine keeps its shards for save_checkpoint/full_state_dict.
        if self.engine is not None and not getattr(self, "_failed", False):
            plugin = self.precision_plugin
            self.engine.release_module(dtype=plugin.param_dtype if plugin.precision.endswith("-true") else None)
        elif self.engine is not None and not self.engine.parts.retired:
            self.engine.hand_back_optimizers()  # no collective: a failed fit's optimizer can be used again
        self._unwrap_averaging()
        self._unwrap_averaging = nothing
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if not getattr(self, "_failed", False):  # after a failure, an asynchronous save may never finish
            self.checkpointer.release()  # waits for an asynchronous save in flight; frees pinned staging

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["engine"] = None  # shards, streams and swap files do not travel; a new setup builds an engine
        state["_unwrap_averaging"] = nothing
        return state

    # ------------------------------------------------------------------ state

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name (frozen ones included) on every rank, or with
        ``rank0_only`` on rank 0 only (gathered unit by unit; other ranks get ``{}``)."""
        if self.engine is not None:
            return zero_state.full_state_dict(self.engine.parts, rank0_only=rank0_only)
        if rank0_only and not self.is_global_zero:
            return {}
        assert self.lightning_module is not None
        return {
            n: p.detach().float().cpu().clone()
            for n, p in self.lightning_module.named_parameters(remove_duplicate=False)
        }

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part: every parameter as chunks of the fp32 masters at full shape (read when the
        checkpoint is written, nothing is gathered), frozen parameters (none with ``exclude_frozen_parameters``)
        and buffers as they are."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        return checkpoint_api.sharded_model_state(self.engine, exclude_frozen=self.exclude_frozen_parameters)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: this rank's part of the optimizer state, keyed by parameter name."""
        if self.engine is None or self.engine.optimizer is None:
            return super().optimizer_state(optimizer)
        return checkpoint_api.sharded_optimizer_state(self.engine)

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
        path = local_checkpoint_path(self.broadcast(str(filepath)))
        checkpoint_glue.save(self, checkpoint, path, self.checkpointer)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is complete (raises its error, if any)."""
        self.checkpointer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Validates the checkpoint on every rank, then reads this rank's part (any world size, stage or
        layout; a directory from FSDP2; a single Lightning file, e.g. from ``strategy="ddp"``).
        ``weights_only=False`` is honored only for single files you trust; directories never need it."""
        state, self._weights_loaded = checkpoint_glue.load(
            self, local_checkpoint_path(checkpoint_path), weights_only, self.checkpointer
        )
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._weights_loaded or "state_dict" not in checkpoint:
            self._weights_loaded = False  # load_checkpoint read them into the shards already
            return
        state = checkpoint["state_dict"]
        assert self.lightning_module is not None  # the Trainer loads a checkpoint into a connected module
        if self.engine is None:
            self.lightning_module.load_state_dict(state, strict=strict)
            return
        missing, unexpected = zero_state.load_module_state_dict(self.engine.parts, self.lightning_module, state)
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
            outside = checkpoint_glue.outside_checkpoint_dirs(self, path)
            if outside is not None:
                rank_zero_warn(
                    f"Not removing {filepath}: it names the checkpoint directory {outside} but resolves "
                    "to a place outside it (a path from an edited trainer state, or a linked directory); "
                    "remove it yourself if it is yours."
                )
                return
            checkpoint_api.remove_checkpoint(path)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)


def _swap_roots(nvme_path: Optional[str]) -> list[str]:
    """Where the launcher looks for the swap directories of the ranks it killed (a module-level
    function: the launcher, and so the Trainer, must pickle)."""
    return [str(nvme_path)] if nvme_path else []


def _check_disjoint(optimizers: list) -> None:
    seen: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if seen.setdefault(id(p), index) != index:
                    raise ValueError(
                        f"configure_optimizers returned optimizers {seen[id(p)]} and {index} sharing a parameter of "
                        f"shape {tuple(p.shape)}; ZeroQ shards each parameter's optimizer state once: give every "
                        "parameter to one optimizer."
                    )
