"""The host kernel's step of offloaded units (``ops.host_adam``), and the bf16 copies it writes.

``KernelSteps`` steps a batch of host units when the optimizer is torch's own Adam or AdamW over every
segment of them, each param group asks for nothing the kernel lacks (AMSGrad, capturable or
differentiable steps, tensor hyperparameters: ``binding.kernel_group``) and the state is Adam's;
otherwise the placement leaves the batch to ``optimizer.step()``. It does what that step would do to
the state, bit for bit: a state made for a parameter's first step as torch's Adam makes it for a
fused step (a float32 step count on the parameter's device, two zeroed moments), the step count
advanced, a parameter without a gradient left alone.

With bf16 working weights the kernel also writes each updated master rounded to bf16 (``working``):
buffers of its own, whose copy crosses PCIe in half the bytes of the master, or a stage-3 host store's,
which then holds the step's payload (``share``). ``copy`` hands it out only while it is the cast of
the master just stepped (``fresh``); anything else that writes a master (a load, a write-back) walks
the units through the placement's ``resident``, which makes the copy stale again.

``set_host_step_threads``: the host step runs on torch's intra-op threads, which ``torchrun`` would
leave at one per rank.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.ops.host_adam import HostAdam
from lightning_zeroq.zero.offload.stores import host_copy
from lightning_zeroq.zero.optim.binding import Binding, adam_kind, kernel_group, stepped_spans
from lightning_zeroq.zero.unit import Unit

_THREADS_SET: list[int] = []


def set_host_step_threads(world_size: int) -> None:
    """The host step runs on torch's intra-op threads. torchrun sets ``OMP_NUM_THREADS=1`` for every
    rank it starts unless the user set it (a step with 1 thread against 16: benchmarks/README.md, the
    offload host step's row): under torchrun with that default, use the cores per local rank and say so once;
    elsewhere, one thread is the user's choice, and gets a warning."""
    if torch.get_num_threads() != 1:
        return
    cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    threads = max(1, cores // max(1, local_ranks))
    if threads == 1:
        return
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(threads)
        if not _THREADS_SET:
            _THREADS_SET.append(threads)
            logging.getLogger("lightning_zeroq").info(
                f"offload_optimizer: torchrun left each rank 1 thread (OMP_NUM_THREADS=1); the host step now uses "
                f"{threads} ({cores} cores / {local_ranks} local ranks). Set OMP_NUM_THREADS to another value to choose."
            )
        return
    warnings.warn(
        "offload_optimizer: the optimizer step runs on the CPU with 1 thread (torch.get_num_threads() == 1). "
        f"Set OMP_NUM_THREADS to the cores per rank, e.g. OMP_NUM_THREADS={threads}, or call torch.set_num_threads().",
        stacklevel=4,
    )


class KernelSteps:
    def __init__(self, kernel: HostAdam, param_dtype: torch.dtype, pin: bool) -> None:
        self.kernel, self.param_dtype, self.pin = kernel, param_dtype, pin
        self.working: dict[int, Tensor] = {}
        """bf16 host copies of the masters (own buffers, or a stage-3 store's)."""
        self.fresh: set[int] = set()
        """Units whose ``working`` copy is the cast of the master this step wrote."""
        self.fresh_spans: dict[int, set[tuple[int, int]]] = {}
        """Per unit: spans of ``working`` a step wrote with their masters (a unit another optimizer shares, or
        a matrix optimizer's), until the publish that follows takes them (``take_fresh_copy``)."""

    def share(self, buffers: dict[int, Tensor]) -> None:
        """Write these units' bf16 copies into ``buffers`` (a stage-3 store's)."""
        if self.param_dtype == torch.bfloat16:
            self.working.update({i: b for i, b in buffers.items() if b.dtype == torch.bfloat16})

    def kernel_args(
        self, batch: Sequence[Unit], binding: Any, shared: bool = False
    ) -> Optional[dict[int, dict[str, Any]]]:
        """Each segment view's kernel arguments (by the view's id) if the kernel steps ``batch``, else
        None. ``binding``: a ``Binding``, or anything with its ``optimizer`` and ``optimized``. ``shared``:
        a unit may have segments the optimizer does not step (another optimizer's, the usual Muon recipe's
        matrices beside AdamW's norms); else such a unit is refused."""
        optimizer = binding.optimizer
        decoupled = adam_kind(optimizer)
        if decoupled is None:
            return None
        group_of = {id(view): group for group in optimizer.param_groups for view in group["params"]}
        hypers: dict[int, dict[str, Any]] = {}
        for unit in batch:
            if not shared and len(binding.optimized[unit.index]) != len(unit.segments):
                return None  # several optimizers share the unit
            for view, _ in binding.optimized[unit.index]:
                group = group_of[id(view)]
                if id(group) not in hypers:
                    hyper = kernel_group(group, decoupled)
                    if hyper is None:
                        return None
                    hypers[id(group)] = hyper
                state = optimizer.state.get(view)
                if view.device.type != "cpu" or (state and not adam_state(state)):
                    return None
        return {id(view): hypers[id(group_of[id(view)])] for unit in batch for view, _ in binding.optimized[unit.index]}

    def step(
        self,
        batch: Sequence[Unit],
        binding: Binding,
        used: Sequence[Any],
        grad_of: Callable[[Unit], Tensor],
        multiplier_of: Callable[[Unit], float],
    ) -> bool:
        """Step ``batch`` (True), or leave it (False: ``kernel_args`` says the kernel does not take it). ``used``:
        per parameter id, whether any rank gave it a gradient; ``grad_of``: a unit's host gradient (fp32
        or bf16) once it has landed; ``multiplier_of``: the multiplier it still owes. A unit whose segments
        are not all this optimizer's gets only its own stepped; its bf16 copy is then not the master's cast
        (the other segments' copies are not written here)."""
        hypers = self.kernel_args(batch, binding, shared=True)
        if hypers is None:
            return False
        jobs = []
        for unit in batch:
            jobs.extend(self.jobs(unit, binding, used, grad_of(unit), multiplier_of(unit), hypers))
        self.kernel.run(jobs)  # the tensors' storages outlive it: masters, gradients, state, copies are kept
        for unit in batch:
            spans = stepped_spans(unit, binding)
            if spans is None:
                self.stepped(unit.index)
            else:
                self.copied(unit, spans)
        return True

    def copied(self, unit: Unit, spans: Sequence[slice]) -> None:
        """These spans of the unit's ``working`` copy were just written with their masters (bf16 only)."""
        if self.param_dtype == torch.bfloat16:
            self.fresh_spans.setdefault(unit.index, set()).update((s.start, s.stop) for s in spans)

    def take_fresh_copy(self, unit: Unit, span: slice) -> Optional[Tensor]:
        """``span`` of the unit's bf16 copy where a step wrote it with its master since it was last taken
        (a publish takes it once), or the whole copy is the master's cast (``fresh``); else None."""
        spans = self.fresh_spans.get(unit.index, set())
        if (span.start, span.stop) in spans:
            spans.discard((span.start, span.stop))
        elif unit.index not in self.fresh:
            return None
        return self.working[unit.index][span]

    def discard(self, index: int) -> None:
        """Unit ``index``'s master may be written by others: its copy is no longer known to be its cast."""
        self.fresh.discard(index)
        self.fresh_spans.pop(index, None)

    def clear(self) -> None:
        self.fresh.clear()
        self.fresh_spans.clear()

    def stepped(self, index: int) -> None:
        """Unit ``index``'s master was just stepped through this kernel (its jobs ran, or a speculative
        step of it was kept): with bf16 working weights, its copy is the new master's cast."""
        if self.param_dtype == torch.bfloat16:
            self.fresh.add(index)

    def jobs(
        self,
        unit: Unit,
        binding: Any,
        used: Any,
        grad: Tensor,
        gmul: float,
        hypers: dict[int, dict[str, Any]],
        out: Optional[Callable[[Tensor, slice], Sequence[Tensor]]] = None,
    ) -> list:
        """The kernel's jobs for one unit (its state made and its step counts advanced as torch would);
        ``used``: indexed by parameter id, whether it is stepped; ``out``: given a segment's view and
        span, the three tensors its updated master, exp_avg and exp_avg_sq go to (the step out of
        place: those it reads stay as they were)."""
        optimizer, working, jobs = binding.optimizer, self.copy_buffer(unit), []
        for view, seg in binding.optimized[unit.index]:
            span = seg.shard_span
            if not used[unit.param_id(seg.param)]:
                if working is not None:  # not stepped: its copy is the master's cast
                    working[span].copy_(unit.master[span])
                continue
            state = optimizer.state[view]
            if not state:  # as torch's Adam makes it for a fused step
                state["step"] = torch.zeros((), dtype=torch.float32, device=view.device)
                state["exp_avg"] = torch.zeros_like(view, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(view, memory_format=torch.preserve_format)
            state["step"].add_(1)
            jobs.append(
                self.kernel.job(
                    view.detach(),
                    grad[span],
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=float(state["step"].item()),
                    gmul=gmul,
                    working=working[span] if working is not None else None,
                    out=out(view, span) if out is not None else None,
                    **hypers[id(view)],
                )
            )
        return jobs

    def copy_buffer(self, unit: Unit) -> Optional[Tensor]:
        """Where the kernel writes the unit's bf16 master copy (bf16 working weights only)."""
        if self.param_dtype != torch.bfloat16:
            return None
        buffer = self.working.get(unit.index)
        if buffer is None:  # the padding is zero in the master and stays zero here
            buffer = self.working[unit.index] = host_copy(unit.master, self.pin, torch.bfloat16)
        return buffer

    def copy(self, unit: Unit, dtype: torch.dtype) -> Optional[Tensor]:
        """The unit's bf16 copy of its master, if the step just wrote it (and ``dtype`` is bf16)."""
        return self.working[unit.index] if unit.index in self.fresh and dtype == torch.bfloat16 else None

    def forget(self, index: int) -> None:
        """Unit ``index`` no longer steps on the host (``auto`` brought it back)."""
        self.discard(index)
        self.working.pop(index, None)


def adam_state(state: dict) -> bool:
    """``state`` is what torch's Adam keeps for a parameter stepped with a fused step (a float32 CPU step
    count, the two moments), as the kernel reads and writes it."""
    step = state.get("step")
    return (
        set(state) == {"step", "exp_avg", "exp_avg_sq"}
        and isinstance(step, Tensor)
        and step.device.type == "cpu"
        and step.dtype == torch.float32
        and step.numel() == 1
        and all(state[k].dtype == torch.float32 and state[k].is_contiguous() for k in ("exp_avg", "exp_avg_sq"))
    )
