"""The ZeRO engine: a short facade over the parts a step flows through (see ``README.md`` here).

Built once per model, in this order:

1. ``recompute.py``: activation checkpointing; ``plan.py``: which parameters form which unit.
2. ``offload/``: where masters and optimizer state live (device, host, NVMe) and, in stage 3, where
   a transient unit's shard rests; ``wire.py``: how shards travel (full width or INT8). Each is an object
   chosen once from the policies (``policies.py``: the ``ZeroConfig`` as small frozen objects at the front
   door); nothing below branches on the mode.
3. ``unit.py``: the units, built one at a time; ``gather.py`` publishes each (stage 3 frees it at once).
4. ``stage3.py`` (stage 3): module hooks that gather and free units; ``reducer.py``: gradient hooks.

One optimizer step:

1. backward, any number of times: ``reducer.py`` reduce-scatters units into fp32 gradient shards.
2. ``finalize_gradients`` (inside the step, or on the first clip): the reducer completes the shards
   and every rank agrees on used parameters and fp16 overflow; unscaling and clipping become one
   gradient multiplier, applied right before the step to the gradients the optimizer reads.
3. ``step``: per batch of resident units (the placement decides), give the optimizer the gradient of
   every used segment (``None`` for unused ones, which torch.optim leaves alone, as with DDP), step,
   and publish the new masters (``gather.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero import access, comm, hybrid, loss_scaler, norms, policies, recompute, state_dict, update
from lightning_zeroq.zero.agreement import Agreement, describe_plan
from lightning_zeroq.zero.gather import Gatherer
from lightning_zeroq.zero.materialize import sync_replicated_state, target_device
from lightning_zeroq.zero.offload import host_part, optimizer_placement, shard_store
from lightning_zeroq.zero.offload.ahead import InStep, StepAhead
from lightning_zeroq.zero.offload.host_need import HostBudget
from lightning_zeroq.zero.optimizers import Binding, bind_to_shards, hand_back, route_zero_grad
from lightning_zeroq.zero.plan import plan
from lightning_zeroq.zero.policies import ModuleUnits
from lightning_zeroq.zero.reducer import Reducer, Window
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
        loss_scaling: use dynamic loss scaling (fp16). device: where the working parameters live
            (default: where the module is). ranks_per_node: what ``shard_group_size="node"`` means here.
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
        ranks_per_node: Optional[int] = None,
    ) -> None:
        self.config, self.module, self.param_dtype = config, module, param_dtype  # the config is not read below
        self.policies = pol = policies.from_config(config, loss_scaling=loss_scaling)
        # Every rank builds the same engine or raises the same error, before any collective (agreement.py).
        with Agreement(group, dict(pol.settings)) as agreed:
            agreed.settings.update(shard_group_size=hybrid.given(pol.sharding.group_size, ranks_per_node),
                                   param_dtype=str(param_dtype), loss_scaling=str(loss_scaling))
            shard_size = hybrid.shard_group_size(pol.sharding.group_size, comm.world(group)[1], ranks_per_node)
            recompute.apply(module, pol.recompute)
            specs = plan(module, trainable_parameters(module), pol.sharding.units)
            agreed.plan = describe_plan(module, specs)
            self.host_memory = HostBudget(pol.offload, ranks_per_node)  # read before any rank allocates
        # ``group``: the world (first broadcast, the step's agreement); ``self.group``: the shard group (hybrid.py).
        self.topology = topo = hybrid.topology(shard_size, pol.quantization, group)
        self.world_group, self.group, self.replica_group = group, topo.group, topo.replica_group
        self.rank, self.world_size, self.replica_rank, self.num_groups = (
            topo.rank, topo.world_size, topo.replica_rank, topo.num_groups)
        if comm.world(group)[0] == 0:
            for message in pol.ineffective:
                warnings.warn(f"ZeroConfig: {message}", stacklevel=2)
        scaling = pol.numerics.loss_scaling
        self.loss_scaler = loss_scaler.from_policy(scaling) if scaling is not None else None
        # What can fail on one rank only (an NVMe path, its free space, the kernel build) fails on all ranks.
        with comm.agreed(group, "building the ZeRO engine"):
            self.device = target_device(module, device)
            layouts = plan_layouts(specs, self.world_size, topo.align(pol.quantization))
            self.placement = optimizer_placement(pol.offload.optimizer, self.device, param_dtype, self.rank,
                                                 self.world_size, layouts, pol.offload.speculative)
            wire = self._wire(layouts, self.group)
            transient = {i: wire.payload_numel(i) for i, spec in enumerate(specs) if not spec.persistent}
            self.host_memory.built(layouts, self.rank, param_dtype, wire.payload_dtype, transient, self.placement)
            store = None
            if transient:
                store = shard_store(pol.offload.parameters, self.device, payload_dtype=wire.payload_dtype,
                                    payload_numels=transient, param_dtype=param_dtype, rank=self.rank,
                                    quantized=pol.quantization.weights,
                                    master_on_device=self.placement.master_on_device,
                                    masters_may_move=self.placement.masters_may_move)
                self.placement.store_built(store)
        sync_replicated_state(module, self.device, group)
        self.gatherer = Gatherer(wire, self.placement, store, self.device, sync_persistent_on_build=topo.int8_weights)
        self.units = build_units(module, specs, layouts, device=self.device, param_dtype=param_dtype, group=group,
                                 adopt_master=self.placement.adopt_master, on_built=self.gatherer.adopt,
                                 shard_rank=self.rank)
        self._param_names = {id(p): name for name, p in module.named_parameters()}  # after materialization
        for unit in self.units:
            for p in unit.params:
                p.__dict__["_zeroq_name"] = self._param_names.get(id(p), "?")  # named in FreedParameter's errors
        self.stage3, units = None, pol.sharding.units
        if transient and isinstance(units, ModuleUnits):  # transient units are stage 3's module units
            self.stage3 = Stage3Coordinator(self.gatherer, self.units, prefetch_depth=units.prefetch_depth,
                                            reshard_after_forward=units.reshard_after_forward)
        self.ahead = InStep()  # StepAhead with offload_async_step: the host step beside the next forward (offload/ahead.py)
        if pol.offload.asynchronous and (host := host_part(self.placement)) is not None:
            own = comm.duplicate(self.group, group)  # the worker's collectives: a group of their own
            publisher = self.gatherer if own is self.group else Gatherer(
                self._wire(layouts, own), self.placement, store, self.device, sync_persistent_on_build=False)
            self.ahead = StepAhead(host, module, [u for u in self.units if not self.placement.master_on_device(u.index)],
                                   publisher.publish, self.device, own_group=None if own is self.group else own)
            self.gatherer.ready = self.ahead.ready
        self.reducer = Reducer(
            self.units,
            placement=self.placement,
            sharding=pol.sharding,
            param_dtype=param_dtype,
            group=group,  # the agreement on used parameters and non-finite gradients spans the world
            device=self.device,
            wire=topo.gradient_wire(self.device, pol.quantization.group_size),
            listener=self.stage3,
        )
        self._all = Binding(None, {}, frozenset(range(self.reducer.num_params)),  # type: ignore[arg-type]
                            frozenset(u.index for u in self.units), [])
        self._attached = update.attached([], self._all)
        """The optimizers attached: one (or none) or several, chosen again at each ``attach_optimizer``."""
        self._base = 1.0
        self.retired = False
        """``release_module`` handed the module back; the state stays readable, training is over."""
        self.closed = False  # see close()
        access.register(self)
        self.steps = 0
        """Optimizer steps attempted (skipped ones included)."""
        self.skipped_steps = 0
        """Steps skipped for fp16 overflow or (``nonfinite_gradients="skip"``) non-finite gradients."""
        if self.device.type == "cuda":  # the module's own tensors left blocks the step's allocations rarely fit
            torch.cuda.empty_cache()

    def _wire(self, layouts, group: Optional[dist.ProcessGroup]) -> Wire:
        if not self.topology.int8_weights:
            return FullWidth(layouts, self.param_dtype, group)
        q = self.policies.quantization
        return Int8(layouts, param_dtype=self.param_dtype, rank=self.rank, group=group, device=self.device,
                    group_size=q.group_size, exact_numel=q.exact_numel, bucket_numel=q.gather_bucket_numel)

    @property
    def num_params(self) -> int:
        return self.reducer.num_params

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer (the first one attached, when there are several)."""
        return self._attached.bindings[0].optimizer if self._attached.bindings else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [b.optimizer for b in self._attached.bindings]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebind ``optimizer``'s param groups to this rank's fp32 master segments.

        The optimizer object itself is kept, so LR schedulers and ``LearningRateMonitor`` that hold it
        keep working; state it holds for a parameter (Adagrad's) is cut to the segments. Several optimizers may be attached if their parameters are
        disjoint; one whose parameters overlap an attached one's replaces it (a new optimizer for the
        same model).
        """
        self.wait_for_step()  # the pending step's jobs belong to the binding replaced here
        binding = bind_to_shards(optimizer, self.module, self.units)
        kept = [b for b in self._attached.bindings if not b.param_ids & binding.param_ids]
        self._attached = update.attached(kept + [binding], self._all)
        route_zero_grad(optimizer, self)
        with comm.agreed(self.world_group, "attaching the optimizer (host memory, NVMe swap space)"):
            self.host_memory.attached(self.optimizers)
            self.placement.attach(self.units, self.optimizers)

    def _binding(self, optimizer: Optional[torch.optim.Optimizer]) -> Binding:
        """The binding of ``optimizer``; without one, the only binding or (none, several) all units."""
        return self._attached.binding(optimizer)

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

    def finalize_gradients(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Complete this window's gradient shards. Returns True if ``optimizer``'s step must be skipped:
        fp16 overflow (the loss scale backs off), or non-finite gradients with
        ``nonfinite_gradients="skip"``. Non-finite gradients otherwise raise ``RuntimeError`` on every
        rank (the window is dropped; the model is untouched).

        Unscaling and clipping are not applied here but folded into one multiplier per optimizer,
        applied once to the gradients it reads (on the host with offload) right before its step.
        """
        if self.reducer.window is not Window.FINALIZED:
            with torch.profiler.record_function("zeroq.finalize"):
                self.reducer.finalize()
            self._base = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            for binding in [*self._attached.bindings, self._all]:
                binding.multiplier, binding.skip = self._base, None
        binding = self._binding(optimizer)
        if binding.skip is None:
            agreement = self.reducer.finalize()  # finalized above: returns the window's agreement
            bad = [u for u in agreement.nonfinite_units if u in binding.unit_ids]
            try:
                binding.skip = bool(bad) and update.decide_nonfinite(
                    agreement, bad, scaler=self.loss_scaler, action=self.policies.numerics.nonfinite_gradients,
                    step=self.steps + 1, names=self._names_of(bad), rank=self.rank)
            except RuntimeError:
                self.reducer.clear()  # the model is untouched and the engine usable (a caller may go on)
                raise
        return binding.skip

    def _names_of(self, unit_indices: list[int], most: int = 4) -> str:
        names = [self._param_names.get(id(p), "?") for i in unit_indices for p in self.units[i].params]
        more = f" and {len(names) - most} more" if len(names) > most else ""
        return ", ".join(names[:most]) + more

    def clip_grad_norm_(self, max_norm: float, optimizer: Optional[torch.optim.Optimizer] = None) -> Tensor:
        """Clip ``optimizer``'s gradients (default: all) by their 2-norm over all ranks; returns the norm."""
        binding = self._binding(optimizer)
        if self.finalize_gradients(optimizer):
            return torch.tensor(float("inf"), device=self.device)
        norm = self._attached.norm(binding, self.units, self.group, self.device) * binding.multiplier
        binding.multiplier *= float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def clip_grad_value_(self, clip_value: float, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        binding = self._binding(optimizer)
        if not self.finalize_gradients(optimizer):
            update.apply_multiplier(binding, self.units, self.placement, self._attached)
            for unit in self.units:
                grad = self.placement.step_grad(unit)
                for span in self._attached.spans(binding, unit):
                    grad[span].clamp_(-clip_value, clip_value)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """Collective: every trainable parameter's gradient norm and their total, from the shards,
        keyed as Lightning's ``grad_norm`` utility keys them; see ``norms.grad_norms``."""
        self.finalize_gradients()
        return norms.grad_norms(self.units, self._param_names, float(norm_type), abs(self._base),
                                self.group, self.device)

    @property
    def has_gradients(self) -> bool:
        """Some backward ran since the last step (or ``zero_grad``)."""
        return self.reducer.window is not Window.EMPTY

    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Apply one update of ``optimizer`` (needed when several are attached) from this window's
        gradients. Returns False if it was skipped."""
        self._check_active()
        if not self._attached.bindings:
            raise RuntimeError("ZeroEngine.step() needs an optimizer: call attach_optimizer() first.")
        binding = self._binding(optimizer)
        if binding is self._all:
            raise ValueError("Several optimizers are attached: name the one to step, engine.step(optimizer).")
        skip = self.finalize_gradients(binding.optimizer)
        if not skip:
            update.apply_multiplier(binding, self.units, self.placement, self._attached)
            used = self.reducer.finalize().used
            if self.ahead.takes(binding, len(self._attached.bindings) > 1):  # device units first, in the step
                ids, on_device = used.tolist(), [u for u in self.units if self.placement.master_on_device(u.index)]
                self.ahead.run(binding, ids, lambda one: update.step_in(one, binding, on_device, self.placement,
                                                                       self.gatherer, ids))
            else:
                update.run(binding, self.units, self.placement, self.gatherer, used)
        if self.loss_scaler is not None:
            self.loss_scaler.update(skip)
        self.steps += 1
        self.skipped_steps += int(skip)
        self._attached.clear(self.reducer, binding)
        self.placement.step_done(self.units, self.optimizers, not skip, self.group)
        return not skip

    def wait_for_step(self) -> None:
        """Wait until the last step's work is done and every unit's weights are published (with
        ``offload_async_step``; otherwise a no-op). Whatever reads or writes masters, state or host
        gradients waits by itself (the host placement's ``settle``: state dicts, checkpoints, the next
        backward, the next step), and a module's forward waits for its own parameters; code that reads
        a parameter's tensor otherwise between a step and the next forward calls this first."""
        self.ahead.drain()

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Drop this window's gradients (of ``optimizer``'s parameters, when several are attached)."""
        self._attached.clear(self.reducer, self._binding(optimizer) if optimizer is not None else None)

    def publish(self) -> None:
        """Bring every unit's working weights up to date with its master shard."""
        for unit in self.placement.resident(self.units):
            self.gatherer.publish(unit)

    # ------------------------------------------------------------------ state

    def full_state_dict(self) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name on every rank (CPU tensors), frozen ones included."""
        return state_dict.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, Tensor]) -> set[str]:
        """Set the fp32 masters (and working copies) from full parameters by name; returns every parameter name."""
        return state_dict.load_full_state_dict(self, state)

    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Collective: every parameter's optimizer state at full shape by name on every rank (CPU tensors)."""
        return state_dict.full_optimizer_state(self)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds on the device, by kind (what a benchmark compares with the formula).
        ``gradient_shards``: the fp32 shards a finalized window holds for the units stepped on the device."""
        def on_device(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor) and t.device == self.device)

        state = [v for s in (self.optimizer.state.values() if self.optimizer else ()) for v in s.values()]
        transient = [u.flat.numel() * u.flat.element_size() for u in self.units if not u.persistent]
        store = self.gatherer.store
        return {
            "masters": on_device(u.master for u in self.units),
            "gradient_shards": on_device(u.grad for u in self.units if self.placement.master_on_device(u.index)),
            "optimizer_state": on_device(state),
            "persistent_units": on_device(u.flat for u in self.units if u.persistent),
            "stored_shards": on_device(store.device_tensors()) if store is not None else 0,
            "largest_transient_unit": max(transient, default=0),
        }

    def gathered_parameters(self, module: Optional[nn.Module] = None,
                            writeback: bool = False) -> contextlib.AbstractContextManager:
        """Collective context manager: the full fp32 parameters of ``module`` (default: all) as plain
        tensors inside; ``writeback=True`` keeps what was changed. See ``access.py``."""
        access.check_module("ZeroEngine.gathered_parameters", module, optional=True)
        return access.gathered_parameters(self, module, writeback)

    def release_module(self, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        """Collective: hand the module back as a plain module with the trained parameters (see
        ``access.py``) and each optimizer bound to its parameters again (``hand_back``); the engine keeps
        its master shards and optimizer state (in a twin of the optimizer) for state dicts."""
        if not self.retired:
            access.release_module(self, dtype, device)
            self.hand_back_optimizers()
            self.retired = True

    def hand_back_optimizers(self) -> None:
        for binding in self._attached.bindings:  # each on the module's parameters again, no collective (hand_back)
            user, twin, placement = binding.optimizer, hand_back(binding), cast(Any, self.placement)
            if getattr(placement, "optimizer", None) is user:
                placement.optimizer = twin

    def close(self) -> None:
        """Remove every hook and swap file; the module keeps its working parameters. ``closed`` then
        says the state is released (NVMe's masters were in the swap files): a save refuses it."""
        self.closed = True
        self.ahead.close()
        self.reducer.close()
        self.placement.close()
        self.gatherer.close()

