"""The ZeRO engine: a short facade over the parts a step flows through (see ``README.md`` here).

Built once per model, in this order:

1. ``plan.py``: which parameters form which unit (stage 1/2 buckets, stage 3 module units).
2. ``offload/``: where masters and optimizer state live (device, host, NVMe) and, in stage 3, where
   a transient unit's shard rests (device, host, NVMe); ``wire.py``: how shards travel (full width
   or INT8). Each is an object chosen once from the config; nothing below branches on the mode.
3. ``unit.py``: the units themselves, built one at a time; ``gather.py`` publishes each as it is
   built (stage 3 frees it at once).
4. ``stage3.py`` (stage 3): module hooks that gather and free units; ``reducer.py``: gradient hooks.

One optimizer step:

1. backward, any number of times: ``reducer.py`` reduce-scatters units into fp32 gradient shards.
2. ``finalize_gradients`` (inside the step, or on the first clip): the reducer completes the shards
   and every rank agrees on used parameters and fp16 overflow; unscaling and clipping become one
   gradient multiplier, applied right before the step to the gradients the optimizer reads.
3. ``step``: per batch of resident units (the placement decides), give the optimizer the gradient of
   every used segment (unused segments get ``None``, so the optimizer leaves value and state alone,
   as ``torch.optim`` does with DDP), step, and publish the new masters (``gather.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero import access, comm, state_dict
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.layout import ALIGN, Segment
from lightning_zeroq.zero.loss_scaler import loss_scaler_from_config
from lightning_zeroq.zero.materialize import sync_replicated_state
from lightning_zeroq.zero.offload import optimizer_placement, shard_store
from lightning_zeroq.zero.optimizers import OneStep, ZeroGradThrough, bind_to_shards
from lightning_zeroq.zero.plan import plan
from lightning_zeroq.zero.reducer import Agreement, Reducer, Window
from lightning_zeroq.zero.stage3 import Stage3Coordinator
from lightning_zeroq.zero.unit import build_units, plan_layouts, trainable_parameters
from lightning_zeroq.zero.wire import FullWidth, Int8, Wire


class ZeroEngine:
    """Shards a module's trainable parameters for ZeRO stages 1, 2 and 3 and steps an optimizer on them.

    Args:
        module: the model; its trainable parameters become views into per-unit flat buffers.
        config: the validated ``ZeroConfig``.
        param_dtype: dtype of the working parameters (fp32, bf16 or fp16); masters are always fp32.
        group: the data-parallel process group (``None``: the default group, or a single process).
        loss_scaling: use dynamic loss scaling (fp16).
        device: where the working parameters live (default: where the module is).
    """

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        *,
        param_dtype: torch.dtype = torch.float32,
        group: Optional[dist.ProcessGroup] = None,
        loss_scaling: bool = False,
        device: Optional[torch.device] = None,
    ) -> None:
        self.config, self.module, self.group, self.param_dtype = config, module, group, param_dtype
        self.rank, self.world_size = comm.world(group)
        if self.rank == 0:
            for message in config.ineffective(loss_scaling):
                warnings.warn(f"ZeroConfig: {message}", stacklevel=2)
        self.loss_scaler = loss_scaler_from_config(config) if loss_scaling else None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.device = _target_device(module, device)
        sync_replicated_state(module, self.device, group)

        specs = plan(module, trainable_parameters(module), config)
        align = math.lcm(ALIGN, config.quantized_weights_group_size) if config.quantized_weights else ALIGN
        layouts = plan_layouts(specs, self.world_size, align)
        self.placement = optimizer_placement(config, self.device, param_dtype, self.rank, self.world_size)
        wire = self._wire(layouts)
        transient = {i: wire.payload_numel(i) for i, spec in enumerate(specs) if not spec.persistent}
        store = None
        if transient:
            store = shard_store(config, self.device, payload_dtype=wire.payload_dtype, payload_numels=transient,
                                param_dtype=param_dtype, rank=self.rank)
        self.gatherer = Gatherer(wire, self.placement, store, self.device,
                                 sync_persistent_on_build=config.quantized_weights)
        self.units = build_units(module, specs, layouts, device=self.device, param_dtype=param_dtype, group=group,
                                 adopt_master=self.placement.adopt_master, on_built=self.gatherer.adopt)
        self._param_names = {id(p): name for name, p in module.named_parameters()}  # after materialization
        for unit in self.units:
            for p in unit.params:
                p._zeroq_name = self._param_names.get(id(p), "?")  # named in FreedParameter's errors
        self.stage3 = Stage3Coordinator(self.gatherer, self.units, config.stage3_prefetch) if transient else None
        self.reducer = Reducer(
            self.units,
            placement=self.placement,
            reduce_every_backward=config.stage >= 2,
            managed=config.managed_gradient_accumulation,
            param_dtype=param_dtype,
            group=group,
            device=self.device,
            overlap_comm=config.overlap_comm,
            listener=self.stage3,
        )
        self._optimized: dict[int, list[tuple[Tensor, Segment]]] = {}
        self._grad_multiplier = 1.0
        self._skip = False
        self.retired = False
        """``release_module`` handed the module back; the state stays readable, training is over."""
        access.register(self)
        self.steps = 0
        """Optimizer steps attempted (skipped ones included)."""
        self.skipped_steps = 0
        """Steps skipped for fp16 overflow or (``nonfinite_gradients="skip"``) non-finite gradients."""

    def _wire(self, layouts) -> Wire:
        if not self.config.quantized_weights:
            return FullWidth(layouts, self.param_dtype, self.group)
        return Int8(
            layouts,
            param_dtype=self.param_dtype,
            rank=self.rank,
            group=self.group,
            device=self.device,
            group_size=self.config.quantized_weights_group_size,
            exact_numel=self.config.quantized_weights_exact_numel,
            bucket_numel=self.config.allgather_bucket_size,
        )

    @property
    def num_params(self) -> int:
        return self.reducer.num_params

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebind ``optimizer``'s param groups to this rank's fp32 master segments.

        The optimizer object itself is kept, so LR schedulers and ``LearningRateMonitor`` that hold it
        keep working; its state starts empty.
        """
        self._optimized = bind_to_shards(optimizer, self.module, self.units, first_time=self.optimizer is None)
        self.optimizer = optimizer
        optimizer.zero_grad = ZeroGradThrough(optimizer, self)  # type: ignore[method-assign]
        self.placement.attach(self.units, optimizer)

    # ------------------------------------------------------------------ backward

    def pre_backward(self, boundary: Optional[bool] = None) -> None:
        """Open a backward pass. ``boundary=True``: the caller knows a step follows this backward (a
        managed accumulation window ends), so stage 1 reduces during it to overlap communication."""
        self._check_active()
        self.reducer.begin_backward(boundary)

    def _check_active(self) -> None:
        if self.retired:
            raise RuntimeError(
                "This ZeroEngine handed its module back (release_module, the strategy's teardown) and cannot "
                "train any more; build a new engine (a new fit does) to train the module again."
            )

    def post_backward(self) -> None:
        """Close the backward pass (idempotent)."""
        self.reducer.end_backward()

    def backward(self, loss: Tensor, boundary: Optional[bool] = None) -> None:
        """``loss.backward()`` bracketed by the engine (scaled for fp16). For plain-PyTorch use."""
        self.pre_backward(boundary)
        (loss * self.loss_scale if self.loss_scaler is not None else loss).backward()
        self.post_backward()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ------------------------------------------------------------------ step

    def finalize_gradients(self) -> bool:
        """Complete this window's gradient shards. Returns True if the step must be skipped: fp16
        overflow (the loss scale backs off), or non-finite gradients with ``nonfinite_gradients="skip"``.
        Non-finite gradients otherwise raise ``RuntimeError`` on every rank.

        Unscaling and clipping are not applied here but folded into one multiplier, applied once to
        the gradients the optimizer reads (on the host with offload) right before the step.
        """
        if self.reducer.window is Window.FINALIZED:
            return self._skip
        agreement = self.reducer.finalize()
        self._skip = not agreement.finite and self._skip_nonfinite(agreement)
        self._grad_multiplier = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return self._skip

    def _skip_nonfinite(self, agreement: Agreement) -> bool:
        scaler = self.loss_scaler
        where = f"on rank(s) {agreement.nonfinite_ranks}, in the gradients of {self._names_of(agreement.nonfinite_units)}"
        if scaler is not None and (not scaler.dynamic or scaler.scale > scaler.min_scale):
            _log(self.rank, f"fp16 overflow in step {self.steps + 1} {where}: step skipped, loss scale "
                            f"{scaler.scale:g} -> {scaler.next_scale(overflow=True):g}")
            return True
        if self.config.nonfinite_gradients == "skip":
            _log(self.rank, f"non-finite gradients in step {self.steps + 1} {where}: step skipped "
                            "(nonfinite_gradients='skip')", logging.WARNING)
            return True
        self.reducer.clear()  # the model is untouched and the engine usable (a caller may go on)
        raise RuntimeError(
            f"ZeroQ: non-finite gradients (inf or NaN) in optimizer step {self.steps + 1} {where}"
            + (f", at the minimum loss scale {scaler.scale:g}" if scaler is not None else "")
            + ". Stepping would write them into the model. Find their source with "
            "torch.autograd.set_detect_anomaly(True) (Trainer(detect_anomaly=True)), lower the learning rate or "
            "clip gradients; or pass nonfinite_gradients='skip' to skip such steps."
        )

    def _names_of(self, unit_indices: list[int], most: int = 4) -> str:
        names = [self._param_names.get(id(p), "?") for i in unit_indices for p in self.units[i].params]
        more = f" and {len(names) - most} more" if len(names) > most else ""
        return ", ".join(names[:most]) + more

    def _apply_grad_multiplier(self) -> None:
        if self._grad_multiplier != 1.0:
            for unit in self.units:
                self.placement.step_grad(unit).mul_(self._grad_multiplier)
            self._grad_multiplier = 1.0

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip the gradient shards by the global 2-norm over all ranks; returns the norm."""
        if self.finalize_gradients():
            return torch.tensor(float("inf"), device=self.device)
        local = torch.zeros((), device=self.device)
        for unit in self.units:  # the device copy: fast even when the step runs on the host
            local += unit.grad.pow(2).sum()
        if self.world_size > 1:
            comm.all_reduce(local, dist.ReduceOp.SUM, self.group)
        norm = local.sqrt() * self._grad_multiplier
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        self._grad_multiplier *= coef
        return norm

    def clip_grad_value_(self, clip_value: float) -> None:
        if not self.finalize_gradients():
            self._apply_grad_multiplier()
            for unit in self.units:
                self.placement.step_grad(unit).clamp_(-clip_value, clip_value)

    @property
    def has_gradients(self) -> bool:
        """Some backward ran since the last step (or ``zero_grad``)."""
        return self.reducer.window is not Window.EMPTY

    def step(self) -> bool:
        """Apply one optimizer update from this window's gradients. Returns False if it was skipped."""
        self._check_active()
        if self.optimizer is None:
            raise RuntimeError("ZeroEngine.step() needs an optimizer: call attach_optimizer() first.")
        skip = self.finalize_gradients()
        if not skip:
            self._apply_grad_multiplier()
            used = self.reducer.agreement.used.tolist()
            with OneStep(self.optimizer) as one_step:
                for units in self.placement.step_batches(self.units):
                    for unit in units:
                        grad = self.placement.step_grad(unit)
                        for view, seg in self._optimized[unit.index]:
                            if used[unit.param_id(seg.param)]:
                                view.grad = grad[seg.shard_span]
                    one_step.step()
                    for unit in units:
                        for view, _ in self._optimized[unit.index]:
                            view.grad = None
                        self.gatherer.publish(unit)
        if self.loss_scaler is not None:
            self.loss_scaler.update(skip)
        self.steps += 1
        self.skipped_steps += int(skip)
        self.reducer.clear()
        return not skip

    def zero_grad(self) -> None:
        """Drop this window's gradients without stepping."""
        self.reducer.clear()

    def publish(self) -> None:
        """Bring every unit's working weights up to date with its master shard."""
        for unit in self.placement.resident(self.units):
            self.gatherer.publish(unit)

    # ------------------------------------------------------------------ state

    def full_state_dict(self) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name on every rank (CPU tensors), frozen ones included."""
        return state_dict.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, Tensor]) -> set[str]:
        """Set the fp32 masters (and the working copies) from full parameters by name; returns the
        names of the engine's parameters (all aliases of tied ones)."""
        return state_dict.load_full_state_dict(self, state)

    def sharded_state_dict(self) -> dict:
        """This rank's masters, optimizer state and loss scale (for checkpoints at the same world size)."""
        return state_dict.sharded_state_dict(self)

    def load_sharded_state_dict(self, state: dict) -> None:
        state_dict.load_sharded_state_dict(self, state)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds on the device, by kind (what a benchmark compares with the formula)."""

        def on_device(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor) and t.device == self.device)

        state = [v for s in (self.optimizer.state.values() if self.optimizer else ()) for v in s.values()]
        transient = [u.flat.numel() * u.flat.element_size() for u in self.units if not u.persistent]
        store = self.gatherer.store
        return {
            "masters": on_device(u.master for u in self.units),
            "gradient_shards": on_device(u.grad for u in self.units),
            "optimizer_state": on_device(state),
            "persistent_units": on_device(u.flat for u in self.units if u.persistent),
            "stored_shards": on_device(store.device_tensors()) if store is not None else 0,
            "largest_transient_unit": max(transient, default=0),
        }

    def gathered_parameters(self, module: Optional[nn.Module] = None,
                            writeback: bool = False) -> contextlib.AbstractContextManager:
        """Collective context manager: the full fp32 parameters of ``module`` (default: all) as plain
        tensors inside; ``writeback=True`` keeps what was changed. See ``access.py``."""
        return access.gathered_parameters(self, module, writeback)

    def release_module(self, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        """Collective: hand the module back as a plain module with the trained parameters (see
        ``access.py``); the engine keeps its master shards and optimizer state for state dicts."""
        if not self.retired:
            access.release_module(self, dtype, device)
            self.retired = True

    def close(self) -> None:
        """Remove every hook and swap file; the module keeps its current (working) parameters."""
        self.reducer.close()
        self.placement.close()
        self.gatherer.close()


def _log(rank: int, message: str, level: int = logging.INFO) -> None:
    if rank == 0:
        logging.getLogger("lightning_zeroq").log(level, message)


def _target_device(module: nn.Module, device: Optional[torch.device]) -> torch.device:
    devices = {t.device for t in [*module.parameters(), *module.buffers()] if not t.is_meta}
    if len(devices) > 1:
        raise ValueError(
            f"ZeroQ needs all parameters and buffers on one device, found {sorted(map(str, devices))}; "
            "create the module on one device (tensors on the meta device are materialized unit by unit)."
        )
    source = devices.pop() if devices else torch.device("cpu")
    target = torch.device(device) if device is not None else source
    if target.type == "meta":
        raise ValueError("ZeroEngine needs a real target device; pass device=... for a module on meta.")
    return target
