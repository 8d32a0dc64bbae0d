"""The ZeRO engine: a short facade over the parts a step flows through (see ``README.md`` here).

Built once per model by ``build.py`` (the ``ZeroConfig`` turned into frozen policies first,
``policies.py``; then the agreement and the unit plan, the groups, the placement, wire and store, the
units, the hooks), into ``Parts``; ``step.Stepper`` owns the optimizer side of a step on them.

One optimizer step:

1. backward, any number of times: ``reducer.py`` reduce-scatters units into fp32 gradient shards.
2. ``finalize_gradients`` (``Stepper.finalize``, inside the step or on the first clip): the reducer completes the shards
   and every rank agrees on used parameters and fp16 overflow, once a window: the ``Stepper`` keeps that
   verdict for the window's decisions and its step; unscaling and clipping become one gradient
   multiplier, applied right before the step to the gradients the optimizer reads.
3. ``step`` (``Stepper.step``): per batch of resident units (the placement decides), give the optimizer the gradient of
   every used segment (``None`` for unused ones, which torch.optim leaves alone, as with DDP), step,
   and publish the new masters (``gather.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero import full_params, policies, state_dict
from lightning_zeroq.zero.build import Parts, build
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler
from lightning_zeroq.zero.optim.binding import Binding
from lightning_zeroq.zero.reducer import Window
from lightning_zeroq.zero.step import Stepper

_ENGINES: "weakref.WeakSet[ZeroEngine]" = weakref.WeakSet()


def owning_engine(module: nn.Module) -> Optional["ZeroEngine"]:
    """The live engine that shards ``module``'s parameters, if any."""
    ids = {id(p) for p in module.parameters()}
    for engine in list(_ENGINES):
        parts = engine.parts
        frozen = parts.frozen.units if parts.frozen is not None else []  # stage 3's frozen parts are sharded too
        if not parts.retired and any(id(p) in ids for u in [*parts.units, *frozen] for p in u.params):
            return engine
    return None


class ZeroEngine:
    """Shards a module's trainable parameters for ZeRO stages 1, 2 and 3 and steps an optimizer on them.

    Args:
        module: the model; its trainable parameters become views into per-unit flat buffers.
        config: the validated ``ZeroConfig``.
        param_dtype: dtype of the working parameters (fp32, bf16 or fp16); masters are always fp32.
        group: the data-parallel process group (``None``: the default group, or a single process).
        loss_scaling: use dynamic loss scaling (fp16). device: where the working parameters live
            (default: where the module is). ranks_per_node: what ``shard_group_size="node"`` means here.

    The engine holds three things: the ``config`` it was given, the ``parts`` built from it
    (``build.py``) and the ``stepper`` that owns the optimizer side of a step (``step.py``); every
    other attribute below reads one of them.
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
        self.config = config  # kept for the caller; below, only the policies made from it are read
        self.parts: Parts = build(
            module,
            policies.from_config(config, loss_scaling=loss_scaling),
            param_dtype=param_dtype,
            group=group,
            device=device,
            ranks_per_node=ranks_per_node,
            loss_scaling=loss_scaling,
        )
        self.stepper = Stepper(self.parts)
        _ENGINES.add(self)

    @property
    def steps(self) -> int:
        """Optimizer steps attempted (skipped ones included)."""
        return self.stepper.steps

    @steps.setter
    def steps(self, value: int) -> None:  # a resumed run counts on from its checkpoint's global step
        self.stepper.steps = value

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for fp16 overflow or (``nonfinite_gradients="skip"``) non-finite gradients."""
        return self.stepper.skipped_steps

    @property
    def num_params(self) -> int:
        return self.parts.reducer.num_params

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer (the first one attached, when there are several)."""
        optimizers = self.stepper.optimizers
        return optimizers[0] if optimizers else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.stepper.optimizers

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebind ``optimizer``'s param groups to this rank's fp32 master segments.

        The optimizer object itself is kept, so LR schedulers and ``LearningRateMonitor`` that hold it
        keep working; state it holds for a parameter (Adagrad's) is cut to the segments. Several
        optimizers may be attached if their parameters are disjoint; one whose parameters overlap an
        attached one's replaces it (a new optimizer for the same model).
        """
        self.stepper.attach(optimizer)

    def _binding(self, optimizer: Optional[torch.optim.Optimizer]) -> Binding:
        """``optimizer``'s binding to the master segments (``Stepper.binding``)."""
        return self.stepper.binding(optimizer)

    # ------------------------------------------------------------------ backward

    def pre_backward(self, boundary: Optional[bool] = None) -> None:
        """Open a backward pass. ``boundary=True``: the caller knows a step follows this backward (a
        managed accumulation window ends), so stage 1 reduces during it to overlap communication."""
        self._check_active()
        # A write into the weights since the last step (a callback's, after it) becomes the masters here,
        # before a speculative host step reads them (fp32; else the step refuses it, ``Stepper.finalize``).
        full_params.take_writes(self.parts)
        self.parts.reducer.begin_backward(boundary)

    def _check_active(self) -> None:
        if self.parts.retired:
            raise RuntimeError(
                "This ZeroEngine handed its module back (release_module, the strategy's teardown) and cannot "
                "train any more; build a new engine (a new fit does) to train the module again."
            )

    def post_backward(self) -> None:
        """Close the backward pass (idempotent)."""
        self.parts.reducer.end_backward()

    def backward(self, loss: Tensor, boundary: Optional[bool] = None) -> None:
        """``loss.backward()`` bracketed by the engine (scaled for fp16). For plain-PyTorch use."""
        self.pre_backward(boundary)
        (loss * self.loss_scale if self.loss_scaler is not None else loss).backward()
        self.post_backward()

    @property
    def loss_scaler(self) -> Optional[DynamicLossScaler]:
        """The dynamic loss scaler (fp16), or None."""
        return self.parts.loss_scaler

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ------------------------------------------------------------------ step (``step.Stepper``)

    def finalize_gradients(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Complete this window's gradient shards. Returns True if ``optimizer``'s step must be skipped:
        fp16 overflow (the loss scale backs off), or non-finite gradients with
        ``nonfinite_gradients="skip"``. Non-finite gradients otherwise raise ``RuntimeError`` on every
        rank (the window is dropped; the model is untouched).

        Unscaling and clipping are not applied here but folded into one multiplier per optimizer,
        applied once to the gradients it reads (on the host with offload) right before its step.
        """
        return self.stepper.finalize(optimizer)

    def clip_grad_norm_(self, max_norm: float, optimizer: Optional[torch.optim.Optimizer] = None) -> Tensor:
        """Clip ``optimizer``'s gradients (default: all) by their 2-norm over all ranks; returns the norm."""
        return self.stepper.clip_norm(max_norm, optimizer)

    def clip_grad_value_(self, clip_value: float, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self.stepper.clip_value(clip_value, optimizer)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """Collective: every trainable parameter's gradient norm and their total, from the shards,
        keyed as Lightning's ``grad_norm`` utility keys them; see ``norms.grad_norms``."""
        return self.stepper.grad_norms(float(norm_type))

    @property
    def has_gradients(self) -> bool:
        """Some backward ran since the last step (or ``zero_grad``)."""
        return self.parts.reducer.window is not Window.EMPTY

    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Apply one update of ``optimizer`` (needed when several are attached) from this window's
        gradients. Returns False if it was skipped."""
        self._check_active()
        return self.stepper.step(optimizer)

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Drop this window's gradients (of ``optimizer``'s parameters, when several are attached)."""
        self.stepper.zero_grad(optimizer)

    def publish(self) -> None:
        """Bring every unit's working weights up to date with its master shard."""
        for unit in self.parts.placement.resident(self.parts.units):
            self.parts.gatherer.publish(unit)

    # ------------------------------------------------------------------ state

    def full_state_dict(self) -> dict[str, Tensor]:
        """Collective: the full fp32 parameters by name on every rank (CPU tensors), frozen ones included."""
        return state_dict.full_state_dict(self.parts)

    def load_full_state_dict(self, state: dict[str, Tensor]) -> set[str]:
        """Set the fp32 masters (and working copies) from full parameters by name; returns every parameter name."""
        return state_dict.load_full_state_dict(self.parts, state)

    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Collective: every parameter's optimizer state at full shape by name on every rank (CPU tensors)."""
        return state_dict.full_optimizer_state(self.parts, self.optimizer)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds on the device, by kind (what a benchmark compares with the formula).
        ``gradient_shards``: the fp32 shards a finalized window holds for the units stepped on the device."""
        parts = self.parts

        def on_device(tensors) -> int:
            return sum(
                t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor) and t.device == parts.device
            )

        state = [v for s in (self.optimizer.state.values() if self.optimizer else ()) for v in s.values()]
        frozen = parts.frozen.units if parts.frozen is not None else []
        owned = parts.frozen.owner if parts.frozen is not None else {}
        transient = [
            u.flat.numel() * u.flat.element_size()
            + (
                u.frozen.flat.numel() * u.frozen.flat.element_size()
                if u.frozen is not None and not u.frozen.persistent
                else 0
            )
            for u in parts.units
            if not u.persistent
        ]
        transient += [
            u.flat.numel() * u.flat.element_size() for u in frozen if u.index not in owned and not u.persistent
        ]
        store = parts.gatherer.store
        sharded = {id(p) for u in frozen for p in u.params}
        return {
            "masters": on_device(u.master for u in parts.units),
            "gradient_shards": on_device(u.grad for u in parts.units if parts.placement.master_on_device(u.index)),
            "optimizer_state": on_device(state),
            "persistent_units": on_device(u.flat for u in parts.units if u.persistent),
            "stored_shards": on_device(store.device_tensors()) if store is not None else 0,
            "largest_transient_unit": max(transient, default=0),
            "frozen_shards": on_device(u.master for u in frozen),
            "frozen_whole": on_device(
                p for p in parts.module.parameters() if not p.requires_grad and id(p) not in sharded
            ),
        }

    def gathered_parameters(
        self, module: Optional[nn.Module] = None, writeback: bool = False
    ) -> contextlib.AbstractContextManager:
        """Collective context manager: the full fp32 parameters of ``module`` (default: all) as plain
        tensors inside; ``writeback=True`` keeps what was changed. See ``full_params.py``."""
        full_params.check_module("ZeroEngine.gathered_parameters", module, optional=True)
        return full_params.gathered_parameters(self.parts, module, writeback)

    def release_module(self, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        """Collective: hand the module back as a plain module with the trained parameters (see
        ``full_params.py``) and each optimizer bound to its parameters again (``hand_back``); the engine keeps
        its master shards and optimizer state (in a twin of the optimizer) for state dicts."""
        if not self.parts.retired:
            full_params.release_module(self.parts, dtype, device)
            self.hand_back_optimizers()
            self.parts.retired = True

    def hand_back_optimizers(self) -> None:
        self.stepper.hand_back()

    def close(self) -> None:
        """Remove every hook and swap file; the module keeps its working parameters. ``closed`` then
        says the state is released (NVMe's masters were in the swap files): a save refuses it."""
        parts = self.parts
        parts.closed = True
        if parts.activations is not None:
            parts.activations.close()  # each module's own forward again
        if parts.async_step is not None:
            parts.async_step.close()
        parts.reducer.close()
        parts.placement.close()
        parts.gatherer.close()
        parts.worker.close()
