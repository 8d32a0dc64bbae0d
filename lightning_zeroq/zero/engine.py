"""The ZeRO engine: units, shards, gradient reduction and the sharded step, for stages 1, 2 and 3.

Lifetimes (per unit, see ``layout.py`` for the words):

- ``flat``: the full working-dtype buffer; the module's parameters are views into it, so forward and
  backward run on ordinary ``nn.Parameter`` objects. Persistent in stages 1/2 (and for stage 3's
  root and small-parameter units); in stage 3 its *storage* exists only while the unit is gathered
  (``stage3.py`` says when), and ``shard`` (this rank's working-dtype slice) is the source of every
  gather.
- ``master``: this rank's fp32 shard of the unit, the only copy the optimizer updates. The optimizer
  sees one view per parameter segment, so its per-parameter state and skipping work unchanged.
- ``grad``: this rank's fp32 gradient shard, accumulated over the window, zeroed after each step.

Phases of one optimizer step:

1. backward (any number of times). A post-accumulate-grad hook marks the parameter as used. If the
   backward *reduces* (always in stage 2; in stage 1 only on the last backward of a managed window)
   a unit is reduce-scattered as soon as all of its parameters have their gradient, in a fixed
   order (reverse unit order) so every rank issues the same collectives; units still waiting when
   the backward ends (unused parameters) are flushed then, with zeros for missing gradients.
2. finalize (once, inside the step, or on the first clip): reduce whatever stage 1 left local, wait
   for the side stream, agree on which parameters any rank used and on fp16 overflow in one MAX
   all-reduce, unscale.
3. step: give the optimizer the gradient of every used segment (unused segments get ``None`` so the
   optimizer leaves value and state alone, as ``torch.optim`` does with DDP), step, write the new
   master shards into the working buffers and all-gather them.

Streams: with ``overlap_comm`` on CUDA, reductions run on a side stream that first waits for the
compute stream; gradient tensors read there are ``record_stream``-ed before they are dropped; the
compute stream waits for the side stream in ``finalize``.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import ALIGN, Segment, UnitLayout, make_layout, plan_units
from lightning_zeroq.zero.loss_scaler import loss_scaler_from_config
from lightning_zeroq.zero.materialize import materialize_meta_params, materialize_meta_state
from lightning_zeroq.zero.nvme_state import NvmeOptimizerState
from lightning_zeroq.swap.nvme import NvmeSwapper, aligned_empty
from lightning_zeroq.zero.optimizers import check_elementwise, prefer_fast_host_step
from lightning_zeroq.zero.quantized_gather import EncodedShard, QuantizedGather
from lightning_zeroq.zero.stage3 import Stage3Coordinator, UnitSpec, plan_module_units

@dataclass(eq=False)
class _Unit:
    index: int
    params: list[nn.Parameter]
    param_ids: list[int]
    layout: UnitLayout
    flat: Tensor
    master: Tensor
    grad: Tensor
    segments: list[Segment]
    segment_masters: list[Tensor]
    module: Optional[nn.Module] = None
    persistent: bool = True
    shard: Optional[Tensor] = None
    """Stage 3, transient units: this rank's working-dtype shard (``None``: gather from ``master``)."""
    encoded: Optional[EncodedShard] = None
    """Stage 3 with quantized weights: this step's encoded shard, the source of every gather."""
    host_grad: Optional[Tensor] = None
    """Optimizer offload: the fp32 gradient shard the host step reads (pinned on CUDA machines)."""
    host_fresh: bool = False
    """``host_grad`` already holds this window's gradients (copied during the boundary backward)."""
    staging: Optional[Tensor] = None
    """Optimizer offload on CUDA: pinned working-dtype copy of the master for the host-to-device copy."""
    gathered: bool = True
    ready: Optional["torch.cuda.Event"] = None
    """Set while a prefetch on the gather stream may still be writing ``flat``."""
    fired: set[int] = field(default_factory=set)
    reduced: bool = False


def _weak_hook(engine: "ZeroEngine") -> Callable[[Tensor], None]:
    """The post-accumulate-grad hook, holding the engine weakly: a hook stored on a parameter is not
    seen by Python's garbage collector, so a strong reference would keep the engine and all its
    buffers alive after the last user reference is gone."""
    ref = weakref.ref(engine)

    def hook(param: Tensor) -> None:
        engine = ref()
        if engine is not None:
            engine._on_grad_ready(param)

    return hook


class ZeroEngine:
    """Shards a module's trainable parameters for ZeRO stages 1, 2 and 3 and steps an optimizer on them.

    Args:
        module: the model; its trainable parameters become views into per-unit flat buffers.
        config: the validated ``ZeroConfig``.
        param_dtype: dtype of the working parameters (fp32, bf16 or fp16); masters are always fp32.
        group: the data-parallel process group (``None``: the default group, or a single process).
        loss_scaling: use dynamic loss scaling (fp16).
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
        config.check_supported()
        self.config = config
        self.module = module
        self.group = group
        self.param_dtype = param_dtype
        self.rank, self.world_size = comm.world(group)
        self.loss_scaler = loss_scaler_from_config(config) if loss_scaling else None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        devices = {t.device for t in [*module.parameters(), *module.buffers()]}
        if len(devices) > 1:
            raise ValueError(
                f"ZeroQ needs all parameters and buffers on one device, found {sorted(map(str, devices))}; "
                "create the module on one device (the meta device is fine for stage 3)."
            )
        source = devices.pop() if devices else torch.device("cpu")
        self.device = torch.device(device) if device is not None else source
        if self.device.type == "meta":
            raise ValueError("ZeroEngine needs a real target device; pass device=... for a module on meta.")
        self._sync_replicated_state()
        params = _trainable_parameters(module)
        self._align = math.lcm(ALIGN, config.quantized_weights_group_size) if config.quantized_weights else ALIGN
        if config.stage == 3:
            specs = plan_module_units(
                module,
                params,
                wrap_classes=config.stage3_wrap_classes,
                unit_size=config.stage3_unit_size,
                persistence_threshold=config.stage3_param_persistence_threshold,
            )
        else:
            plan = plan_units([p.numel() for p in params], config.reduce_bucket_size)
            specs = [UnitSpec([params[i] for i in members], None, True) for members in plan]
        self._gather_stream = comm.side_stream(self.device) if config.stage == 3 else None
        self._nvme: Optional[NvmeOptimizerState] = None  # set by attach_optimizer
        self._param_swap: Optional[NvmeSwapper] = None
        self.units = self._build_units(specs)
        self._quantized_gather: Optional[QuantizedGather] = None
        if config.quantized_weights:
            self._quantized_gather = QuantizedGather(
                [u.layout for u in self.units],
                rank=self.rank,
                group=group,
                device=self.device,
                group_size=config.quantized_weights_group_size,
                exact_numel=config.quantized_weights_exact_numel,
                bucket_numel=config.allgather_bucket_size,
            )
            self.publish()  # the working weights are always what a gather produces
        if config.offload_parameters and config.offload_params_device == "nvme":
            self._swap_out_parameters()
        self._coordinator = None
        if config.stage == 3:
            self._coordinator = Stage3Coordinator(self, self.units, prefetch=config.stage3_prefetch)
        self._where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        self._reduce_order = list(reversed(self.units))
        self._stream = comm.side_stream(self.device) if config.overlap_comm else None
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for u in self.units for p in u.params]
        self._used: set[int] = set()
        self._open = False
        self._reduce_now = False
        self._boundary_now = False
        self._callback_queued = False
        self._next_reduce = 0
        self._pending_local = False
        self._finalized: Optional[bool] = None

    # ------------------------------------------------------------------ setup

    def _sync_replicated_state(self) -> None:
        """Move frozen parameters and buffers to the device and start from rank 0's values everywhere,
        as DDP does (trainable parameters get the same through their unit buffers)."""
        materialize_meta_state(self.module, self.device, trainable=False)
        with torch.no_grad():
            for t in [*(p for p in self.module.parameters() if not p.requires_grad), *self.module.buffers()]:
                t.data = t.data.to(self.device)
                if self.world_size > 1:
                    comm.broadcast(t.data, 0, self.group)

    def _build_units(self, specs: list[UnitSpec]) -> list[_Unit]:
        """Flatten, broadcast from rank 0 and shard each unit, one at a time (bounded memory)."""
        units = []
        next_id = 0
        renamed: dict[int, nn.Parameter] = {}
        for index, (unit_params, unit_module, persistent) in enumerate(specs):
            materialize_meta_params(self.module, unit_params, self.device, renamed)
            layout = make_layout([p.numel() for p in unit_params], self.world_size, self._align)
            full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for p, slot in zip(unit_params, layout.slots):
                    full[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                if self.world_size > 1:
                    comm.broadcast(full, 0, self.group)
            lo, hi = layout.shard_range(self.rank)
            master = self._host(full[lo:hi]) if self.config.offload_optimizer else full[lo:hi].clone()
            flat = full.to(self.param_dtype) if self.param_dtype != torch.float32 else full
            for p, slot in zip(unit_params, layout.slots):
                p.data = flat[slot.offset : slot.offset + slot.numel].view(p.shape)
            segments = layout.segments(self.rank)
            shard = None
            if not persistent and not self.config.quantized_weights and (
                self.param_dtype != torch.float32 or self.config.offload_optimizer or self.config.offload_parameters
            ):
                shard = self._host(flat[lo:hi]) if self.config.offload_parameters else flat[lo:hi].clone()
            host_grad = staging = None
            if self.config.offload_optimizer:
                host_grad = self._host(torch.zeros_like(master))
                if self.device.type == "cuda":
                    staging = self._host(torch.empty(layout.shard_numel, dtype=self.param_dtype))
            if not persistent:
                flat.untyped_storage().resize_(0)
            units.append(
                _Unit(
                    index=index,
                    params=unit_params,
                    param_ids=list(range(next_id, next_id + len(unit_params))),
                    layout=layout,
                    flat=flat,
                    master=master,
                    grad=torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device),
                    segments=segments,
                    segment_masters=[master[s.shard_start : s.shard_start + s.numel] for s in segments],
                    module=unit_module,
                    persistent=persistent,
                    shard=shard,
                    host_grad=host_grad,
                    staging=staging,
                    gathered=persistent,
                )
            )
            next_id += len(unit_params)
        self.num_params = next_id
        return units

    def _with_masters(self) -> Iterator[_Unit]:
        """The units in order, each with its master shard (and optimizer state) resident while the
        caller uses it: a plain walk, or, with NVMe offload, a read-ahead / write-back walk."""
        if self._nvme is None:
            yield from self.units
        else:
            yield from self._nvme.resident(self.units)

    def _host(self, tensor: Tensor) -> Tensor:
        """A host copy of ``tensor``, pinned where a GPU will copy from or to it."""
        host = tensor.detach().to("cpu", copy=True)
        return host.pin_memory() if self.device.type == "cuda" else host

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebind ``optimizer``'s param groups to this rank's fp32 master segments.

        The optimizer object itself is kept, so LR schedulers and ``LearningRateMonitor`` that hold it
        keep working; its state starts empty.
        """
        check_elementwise(optimizer)
        group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in group_of:
                    raise ValueError("A parameter appears in two optimizer param groups; list each once.")
                group_of[id(p)] = gi
        module_params = {id(p) for p in self.module.parameters()}
        foreign = [k for k in group_of if k not in module_params]
        if foreign and self.optimizer is None:
            raise ValueError(
                f"The optimizer holds {len(foreign)} tensor(s) that are not parameters of the module; "
                "build the optimizer from self.parameters() in configure_optimizers."
            )
        new_params: list[list[Tensor]] = [[] for _ in optimizer.param_groups]
        # Per unit, the (master segment, segment) pairs the optimizer steps.
        self._optimized: dict[int, list[tuple[Tensor, Segment]]] = {u.index: [] for u in self.units}
        for unit in self.units:
            for seg, seg_master in zip(unit.segments, unit.segment_masters):
                gi = group_of.get(id(unit.params[seg.param]))
                if gi is not None:
                    new_params[gi].append(seg_master)
                    self._optimized[unit.index].append((seg_master, seg))
        for group, seg_params in zip(optimizer.param_groups, new_params):
            group["params"] = seg_params
            if self.config.offload_optimizer:
                prefer_fast_host_step(optimizer, group)
        optimizer.state.clear()
        self.optimizer = optimizer
        if self.config.offload_optimizer and torch.get_num_threads() == 1 and (os.cpu_count() or 1) > self.world_size:
            warnings.warn(
                "offload_optimizer: the optimizer step runs on the CPU with 1 thread (torch.get_num_threads() "
                "== 1; torchrun sets OMP_NUM_THREADS=1). Set OMP_NUM_THREADS to the cores per rank, e.g. "
                f"OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // self.world_size)}, or call torch.set_num_threads().",
                stacklevel=2,
            )
        if self.config.offload_optimizer and self.config.offload_optimizer_device == "nvme":
            if self._nvme is None:
                self._nvme = NvmeOptimizerState(
                    self.config.nvme_path, self.rank, self.units, optimizer, pin=self.device.type == "cuda"
                )
            else:  # a new optimizer for the same model (another fit): fresh state, same masters
                self._nvme.rebind(optimizer)

    # ------------------------------------------------------------------ backward

    def pre_backward(self, boundary: Optional[bool] = None) -> None:
        """Open a backward pass. ``boundary=True``: the caller knows a step follows this backward (a
        managed accumulation window ends), so stage 1 reduces during it to overlap communication."""
        if self._finalized is not None:
            raise RuntimeError(
                "backward() after the gradients were finalized for a step (clip_gradients or a step that "
                "was skipped half-way); call the optimizer step before the next backward."
            )
        self._open = True
        self._callback_queued = False
        managed_boundary = boundary is True and self.config.managed_gradient_accumulation
        self._boundary_now = managed_boundary
        self._reduce_now = self.config.stage >= 2 or managed_boundary
        self._next_reduce = 0
        for unit in self.units:
            unit.fired.clear()
            unit.reduced = False
            unit.host_fresh = False
        if not self._reduce_now:
            self._pending_local = True

    def _on_grad_ready(self, param: Tensor) -> None:
        if not self._open:
            self.pre_backward(None)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.post_backward)
            self._callback_queued = True
        unit, i = self._where[id(param)]
        self._used.add(unit.param_ids[i])
        if self._reduce_now:
            unit.fired.add(i)
            self._launch_ready()

    def _launch_ready(self) -> None:
        order = self._reduce_order
        while self._next_reduce < len(order):
            unit = order[self._next_reduce]
            if len(unit.fired) < len(unit.params):
                return
            self._reduce(unit)
            self._next_reduce += 1

    def post_backward(self) -> None:
        """Close the backward pass: flush the units still waiting (idempotent)."""
        if not self._open:
            return
        if self._reduce_now:
            for unit in self._reduce_order[self._next_reduce :]:
                self._reduce(unit)
            self._next_reduce = len(self._reduce_order)
            self._pending_local = False
        if self._coordinator is not None:
            for unit in self.units:
                self.free_unit(unit)
            self._coordinator.end_backward()
        self._open = False

    def backward(self, loss: Tensor, boundary: Optional[bool] = None) -> None:
        """``loss.backward()`` bracketed by the engine (scaled for fp16). For plain-PyTorch use."""
        self.pre_backward(boundary)
        (loss * self.loss_scale if self.loss_scaler is not None else loss).backward()
        self.post_backward()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _comm_context(self) -> contextlib.AbstractContextManager:
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _reduce(self, unit: _Unit) -> None:
        """Reduce-scatter the unit's local gradients into its fp32 gradient shard."""
        layout = unit.layout
        with self._comm_context(), torch.no_grad():
            flat_grad = torch.zeros(layout.padded_numel, dtype=self.param_dtype, device=self.device)
            for p, slot in zip(unit.params, layout.slots):
                if p.grad is not None:
                    flat_grad[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                    if self._stream is not None:
                        p.grad.record_stream(self._stream)
                    p.grad = None
            if self.world_size > 1:
                # Divide before summing so fp16/bf16 sums cannot overflow (SUM: AVG is NCCL-only).
                flat_grad.div_(self.world_size)
                shard = torch.empty(layout.shard_numel, dtype=self.param_dtype, device=self.device)
                comm.reduce_scatter(shard, flat_grad, self.group)
            else:
                shard = flat_grad
            unit.grad.add_(shard)
            if unit.host_grad is not None and self._boundary_now:
                # Managed window's last backward: the copy to the host overlaps the rest of backward.
                unit.host_grad.copy_(unit.grad, non_blocking=True)
                unit.host_fresh = True
        unit.reduced = True
        self.free_unit(unit)

    # ------------------------------------------------------------------ step

    def finalize_gradients(self) -> bool:
        """Complete this window's gradient shards. Returns True if fp16 overflowed (skip the step).

        Unscaling and clipping are not applied here but folded into ``_grad_multiplier``, applied once
        to the gradients the optimizer reads (on the host with offload) right before the step.
        """
        if self._finalized is not None:
            return self._finalized
        self.post_backward()
        if self._pending_local:
            for unit in self._reduce_order:
                self._reduce(unit)
            self._pending_local = False
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self._stream is not None:
            current.wait_stream(self._stream)
        for unit in self.units:
            if unit.host_grad is not None and not unit.host_fresh:
                unit.host_grad.copy_(unit.grad, non_blocking=True)
                unit.host_fresh = True
        stats = torch.zeros(self.num_params + 1, device=self.device)
        if self._used:
            stats[list(self._used)] = 1.0
        if self.loss_scaler is not None:
            local = torch.stack([u.grad.sum() for u in self.units]).sum() if self.units else stats[0]
            stats[-1] = (~torch.isfinite(local)).float()
        if self.world_size > 1:
            comm.all_reduce(stats, dist.ReduceOp.MAX, self.group)
        self._used_global = stats[:-1] > 0
        found_inf = bool(stats[-1].item() > 0)  # also waits for the copies to the host
        self._grad_multiplier = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self._finalized = found_inf
        return found_inf

    def _step_grad(self, unit: _Unit) -> Tensor:
        """The gradient shard the optimizer reads: on the host with optimizer offload."""
        return unit.host_grad if unit.host_grad is not None else unit.grad

    def _apply_grad_multiplier(self) -> None:
        if self._grad_multiplier != 1.0:
            for unit in self.units:
                self._step_grad(unit).mul_(self._grad_multiplier)
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
                self._step_grad(unit).clamp_(-clip_value, clip_value)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:
        """Apply one optimizer update from this window's gradients. Returns False if it was skipped."""
        if self.optimizer is None:
            raise RuntimeError("ZeroEngine.step() needs an optimizer: call attach_optimizer() first.")
        found_inf = self.finalize_gradients()
        if not found_inf:
            self._apply_grad_multiplier()
            used = self._used_global.tolist()
            # With offload the host steps unit by unit, so the copy back and the gather of one unit
            # (asynchronous on the GPU) overlap the host update of the next.
            batches = ([u] for u in self._with_masters()) if self.config.offload_optimizer else [self.units]
            for units in batches:
                for unit in units:
                    grad = self._step_grad(unit)
                    for seg_master, seg in self._optimized[unit.index]:
                        if used[unit.param_ids[seg.param]]:
                            seg_master.grad = grad[seg.shard_start : seg.shard_start + seg.numel]
                self.optimizer.step()
                for unit in units:
                    for seg_master, _ in self._optimized[unit.index]:
                        seg_master.grad = None
                    self._publish_unit(unit)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        self._end_window()
        return not found_inf

    def _end_window(self) -> None:
        for unit in self.units:
            unit.grad.zero_()
            for p in unit.params:
                p.grad = None
        self._used.clear()
        self._finalized = None
        self._pending_local = False

    def zero_grad(self) -> None:
        """Drop this window's gradients without stepping."""
        self.post_backward()
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._end_window()

    def publish(self) -> None:
        """Bring every unit's working weights up to date with its master shard."""
        for unit in self._with_masters():
            self._publish_unit(unit)

    @torch.no_grad()
    def _publish_unit(self, unit: _Unit) -> None:
        """Persistent units: write the master shard into the working buffer and all-gather it.
        Stage 3 transient units: refresh the source of later gathers (working shard or encoded)."""
        if not unit.persistent:
            if self._quantized_gather is not None:
                unit.encoded = self._quantized_gather.encode(unit.index, self._master_on_device(unit), self.param_dtype)
            elif self._param_swap is not None:
                self._param_swap.write(f"p{unit.index}", unit.master.to(self.param_dtype))
            elif unit.shard is not None:
                unit.shard.copy_(unit.master)
            if unit.gathered:  # gathered outside a step (e.g. a validation forward in progress)
                self.free_unit(unit)
            return
        if self._quantized_gather is not None:
            self._quantized_gather.gather(unit.index, self._master_on_device(unit), unit.flat, unit.layout)
        else:
            comm.all_gather(unit.flat, self._working_shard(unit), self.group)

    def _master_on_device(self, unit: _Unit) -> Tensor:
        return unit.master.to(self.device, non_blocking=True)

    def _working_shard(self, unit: _Unit) -> Tensor:
        """This rank's master shard in the working dtype, on the device."""
        if unit.staging is not None:  # host master: cast on the host, copy half the bytes
            unit.staging.copy_(unit.master)
            return unit.staging.to(self.device, non_blocking=True)
        return unit.master.to(device=self.device, dtype=self.param_dtype)

    # ------------------------------------------------------------------ stage 3 gathers

    @torch.no_grad()
    def gather_unit(self, unit: _Unit, prefetch: bool = False) -> None:
        """Give a transient unit its full working buffer (no-op if gathered). ``prefetch``: on CUDA, run
        the all-gather on the gather stream; the first real use waits for it."""
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if unit.gathered:
            if unit.ready is not None and not prefetch:
                current.wait_event(unit.ready)
                unit.ready = None
            return
        flat = unit.flat
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        if prefetch and self._gather_stream is not None:
            self._gather_stream.wait_stream(current)
            with torch.cuda.stream(self._gather_stream):
                self._fill(unit)
                unit.ready = torch.cuda.Event()
                unit.ready.record(self._gather_stream)
        else:
            self._fill(unit)
        unit.gathered = True

    def _fill(self, unit: _Unit) -> None:
        if unit.encoded is not None:
            assert self._quantized_gather is not None
            self._quantized_gather.gather_encoded(unit.index, unit.encoded, unit.flat, unit.layout)
            return
        if self._param_swap is not None:  # parameter offload to NVMe: read this rank's shard first
            source = aligned_empty(unit.layout.shard_numel, self.param_dtype, pin_memory=self.device.type == "cuda")
            self._param_swap.read(f"p{unit.index}", source)
        else:
            source = unit.shard if unit.shard is not None else unit.master
        comm.all_gather(unit.flat, source.to(self.device, non_blocking=True), self.group)

    def _swap_out_parameters(self) -> None:
        """Stage 3 parameter offload to NVMe: every transient unit's working shard goes to a swap file
        (free space checked first) and is read back before each gather."""
        swap = NvmeSwapper(self.config.nvme_path, rank=self.rank, prefix="zeroq_params",
                           pin_memory=self.device.type == "cuda")
        transient = [u for u in self.units if not u.persistent]
        for unit in transient:
            swap.register(f"p{unit.index}", unit.layout.shard_numel, self.param_dtype)
        swap.reserve()
        for unit in transient:
            swap.write(f"p{unit.index}", unit.shard)
            unit.shard = None
        self._param_swap = swap

    def free_unit(self, unit: _Unit) -> None:
        """Release a transient unit's full buffer (its parameters keep their shapes)."""
        if unit.persistent or not unit.gathered:
            return
        if unit.ready is not None:  # prefetched and never used: let the gather finish first
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
            unit.ready = None
        unit.flat.untyped_storage().resize_(0)
        unit.gathered = False

    # ------------------------------------------------------------------ state

    def _named_managed(self) -> Iterator[tuple[list[str], _Unit, int]]:
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for unit in self.units:
            for i, p in enumerate(unit.params):
                yield names.get(id(p), []), unit, i

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name on every rank (CPU tensors), frozen ones included."""
        out: dict[str, Tensor] = {}
        fulls = {}
        for unit in self._with_masters():
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=self.device)
            comm.all_gather(full, self._master_on_device(unit), self.group)
            fulls[unit.index] = full.cpu()
        for names, unit, i in self._named_managed():
            slot, p = unit.layout.slots[i], unit.params[i]
            value = fulls[unit.index][slot.offset : slot.offset + slot.numel].view(p.shape).clone()
            for name in names:
                out[name] = value
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name not in out:
                out[name] = p.detach().float().cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, Tensor]) -> set[str]:
        """Set the fp32 masters (and the working copies) from full parameters by name; returns the
        names of the engine's parameters (all aliases of tied ones)."""
        managed: set[str] = set()
        by_unit: dict[int, list[tuple[list[str], int]]] = {u.index: [] for u in self.units}
        for names, owner, i in self._named_managed():
            by_unit[owner.index].append((names, i))
        for unit in self._with_masters():
            for names, i in by_unit[unit.index]:
                managed.update(names)
                name = next((n for n in names if n in state), None)
                if name is None:
                    continue
                slot = unit.layout.slots[i]
                lo, hi = unit.layout.shard_range(self.rank)
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start < end:
                    value = state[name].reshape(-1)[start - slot.offset : end - slot.offset]
                    unit.master[start - lo : end - lo].copy_(value)
            self._publish_unit(unit)
        return managed

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's masters, optimizer state and loss scale (for checkpoints at the same world size)."""
        masters, state = [], {}
        for unit in self._with_masters():  # with NVMe offload: one unit resident at a time
            masters.append(unit.master.detach().cpu().clone())
            if self.optimizer is not None:
                for seg_master in unit.segment_masters:
                    if seg_master in self.optimizer.state:
                        state[id(seg_master)] = {
                            k: v.clone() if isinstance(v, Tensor) else v for k, v in self.optimizer.state[seg_master].items()
                        }
        optimizer_state = None
        if self.optimizer is not None:
            optimizer_state = self.optimizer.state_dict()  # param_groups; state rebuilt from the clones
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            optimizer_state["state"] = {i: state[id(p)] for i, p in enumerate(params) if id(p) in state}
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "unit_numels": [u.layout.numel for u in self.units],
            "masters": masters,
            "optimizer": optimizer_state,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        numels = [u.layout.numel for u in self.units]
        if state["world_size"] != self.world_size or state["unit_numels"] != numels:
            raise ValueError(
                f"This sharded checkpoint was written by {state['world_size']} ranks with units "
                f"{state['unit_numels'][:4]}...; this run has {self.world_size} ranks and units {numels[:4]}... "
                "Resume with the same number of devices and the same reduce_bucket_size."
            )
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            if self._nvme is not None:
                self._nvme.rebind(self.optimizer)  # the loaded state replaces what is on disk
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for unit in self._with_masters():
            unit.master.copy_(state["masters"][unit.index])
            self._publish_unit(unit)

    def release_swap_files(self) -> None:
        """NVMe offload: bring the master shards back to host memory, drop the optimizer state and
        remove the swap files (the strategy's teardown). A later ``attach_optimizer`` swaps again;
        parameters stay in host memory from then on."""
        if self._param_swap is not None:
            for unit in self._with_masters():
                if not unit.persistent:
                    unit.shard = self._host(unit.master.to(self.param_dtype))
            self._param_swap.close()
            self._param_swap = None
        if self._nvme is None:
            return
        self._nvme.flush()
        if self.optimizer is not None:
            self.optimizer.state.clear()
        self._nvme.rebind(self.optimizer)
        for unit in self.units:
            self._nvme.load(unit)
        self._nvme.close()
        self._nvme = None

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._coordinator is not None:
            self._coordinator.close()
        if self._nvme is not None:
            self._nvme.close()
        if self._param_swap is not None:
            self._param_swap.close()


def _trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters in registration order, each once (tied weights are one parameter)."""
    return [p for p in module.parameters() if p.requires_grad]
