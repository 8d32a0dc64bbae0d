"""NVMe offload: optimizer state (all stages) and stage-3 parameter shards in swap files.

Optimizer. Each unit's fp32 master shard and per-element optimizer state live in swap files between
steps and in host memory only while that unit steps (the rest is as with CPU offload, ``host.py``).
Host buffers come from a ``BufferPool`` and are reused every step (pinned memory is slow to
allocate). Regions (one file each, ``lightning_zeroq.swap.NvmeSwapper``): ``u<i>.master`` and ``u<i>.<key>`` for
every per-element state key of the optimizer (``exp_avg``, ``exp_avg_sq`` for AdamW). The keys are
found up front by stepping a throw-away copy of the optimizer on a small tensor, so every region is
registered, and the free space checked, before training starts. Scalar state (Adam's ``step``)
stays in memory.

Residency. The optimizer keeps its own tensor objects (its parameters are the master segments, its
state tensors hang off them); loading a unit points their ``.data`` at fresh host buffers read from
disk, storing it writes the buffers back and points ``.data`` at empty placeholders. The step walks
the units in order: unit ``i+1`` is read ahead (straight into pool buffers) while unit ``i`` steps, and
unit ``i`` is written back while the next ones step (at most ``WRITES_IN_FLIGHT`` writes behind, whose
buffers then go back to the pool), so at most ``UNITS_IN_FLIGHT`` units' buffers of each size are held
(``step_buffer_elements``, which the host check counts). An I/O error, a short read or a swap file
that changed size raises ``RuntimeError`` naming the file before any step runs on the data.

Parameters (stage 3). A transient unit's payload (working shard or INT8 encoding) is written to its
region after each step and read back (into an aligned, pinned buffer) before each gather.
"""

from __future__ import annotations

import inspect
import threading
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.swap import NvmeSwapper, SwapHandle, aligned_empty
from lightning_zeroq.zero.offload.host import HostOptimizer
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.optim.matrix import is_matrix_optimizer
from lightning_zeroq.zero.unit import Unit

WRITES_IN_FLIGHT = 2
"""Units whose write-back may still be running while the walk goes on. Past it the oldest is waited for
and its buffers reused, so a step holds a few units' buffers, not every swapped unit's."""

UNITS_IN_FLIGHT = 2 + WRITES_IN_FLIGHT
"""Units whose step buffers (master and per-element state) a walk holds at once: the one stepping, the
one read ahead, and the writes behind."""


def step_buffer_elements(shard_numels: Sequence[int]) -> int:
    """The elements of each step buffer kind (master, one per state key) the pool holds at most while the
    walk steps units of these shard sizes: buffers are reused by size, so per size at most
    ``UNITS_IN_FLIGHT`` units' worth."""
    counts: dict[int, int] = {}
    for numel in shard_numels:
        counts[numel] = counts.get(numel, 0) + 1
    return sum(numel * min(count, UNITS_IN_FLIGHT) for numel, count in counts.items())


class BufferPool:
    """Aligned host buffers (pinned on CUDA machines) reused from step to step: pinning memory costs
    far more than reading a unit from disk, so each size is allocated once. A buffer given back is
    handed out again only after the device finished with it (an event recorded when it came back)."""

    def __init__(self, dtype: torch.dtype, pin: bool) -> None:
        self.dtype, self.pin = dtype, pin
        self._free: dict[int, list[tuple[Tensor, Optional["torch.cuda.Event"]]]] = {}

    def take(self, numel: int) -> Tensor:
        free = self._free.get(numel)
        if free:
            buffer, event = free.pop()
            if event is not None:
                event.synchronize()
            return buffer
        return aligned_empty(numel, self.dtype, pin_memory=self.pin)

    def give(self, buffer: Tensor) -> None:
        event = None
        if self.pin and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()  # after every copy from this buffer already issued on this stream
        self._free.setdefault(buffer.numel(), []).append((buffer, event))


def swap_key(unit_index: int, kind: str) -> str:
    """The swap region of one unit's ``kind`` (``master``, an optimizer state key, or ``param``)."""
    return f"u{unit_index}.{kind}"


def per_element_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The state keys whose tensors have one element per parameter element, for this optimizer."""
    probe = torch.zeros(4, 4, requires_grad=True)  # a matrix: Muon steps nothing else
    accepted = inspect.signature(type(optimizer).__init__).parameters
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    twin = type(optimizer)([probe], **{k: v for k, v in group.items() if k in accepted and k != "params"})
    probe.grad = torch.ones_like(probe)
    twin.step()
    return sorted(k for k, v in twin.state[probe].items() if isinstance(v, Tensor) and v.numel() == probe.numel())


class NvmeOptimizer(HostOptimizer):
    """Masters and per-element optimizer state in swap files; resident only while a unit steps. The
    units not in ``on_disk`` (default: every unit is) keep theirs in host memory, as with CPU offload
    (``offload_optimizer_nvme_ratio`` below 1: the state spills to disk only as far as the host needs)."""

    def __init__(
        self,
        device: torch.device,
        param_dtype: torch.dtype,
        world_size: int,
        worker: HostWorker,
        *,
        nvme_path: str,
        rank: int,
        on_disk: Optional[frozenset[int]] = None,
    ) -> None:
        super().__init__(device, param_dtype, world_size, worker)
        self.nvme_path, self.rank, self.on_disk = nvme_path, rank, on_disk
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.keys: list[str] = []
        self.swapper: Optional[NvmeSwapper] = None
        self._state_on_disk: set[int] = set()
        self._resident: dict[int, dict[str, Tensor]] = {}
        self._ahead: dict[int, dict[str, Tensor]] = {}
        """Pool buffers a read-ahead is filling, per unit."""
        self._writing: dict[int, tuple[list[SwapHandle], list[Tensor]]] = {}
        self._pool = BufferPool(torch.float32, self.pin)

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if any(is_matrix_optimizer(o) for o in optimizers):
            raise ValueError(
                "NVMe optimizer offload does not take Muon yet (its matrices are gathered whole at the step); use "
                "offload_optimizer_device='cpu', which does."
            )
        if len(optimizers) > 1:
            raise ValueError(
                f"NVMe optimizer offload swaps one optimizer's state; {len(optimizers)} are attached. Use one "
                "optimizer with several param groups, or offload_optimizer_device='cpu'."
            )
        super().attach(units, optimizers)
        optimizer = optimizers[0]
        self.optimizer = optimizer
        self._state_on_disk.clear()  # a new optimizer (another fit, a loaded checkpoint): its state wins
        if self.swapper is not None:
            return
        self.keys = per_element_state_keys(optimizer)
        self.swapper = NvmeSwapper(self.nvme_path, rank=self.rank, pin_memory=self.pin)
        swapped = [unit for unit in units if self._swaps(unit)]
        for unit in swapped:
            for name in ["master", *self.keys]:
                self.swapper.register(swap_key(unit.index, name), unit.layout.shard_numel, torch.float32)
        self.swapper.reserve()  # checks the free space for every region before anything is written
        for unit in swapped:
            self.swapper.write(swap_key(unit.index, "master"), unit.master)
            self._evict(unit)

    def _swaps(self, unit: Unit) -> bool:
        """Whether ``unit``'s master and state live on disk (else in host memory all along)."""
        return self.on_disk is None or unit.index in self.on_disk

    def state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` (its state just loaded) from now on; it replaces the state on disk as each
        unit is next stored."""
        self.optimizer = optimizer
        self._state_on_disk.clear()

    def optimizer_replaced(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        if self.optimizer is old:
            self.optimizer = new

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        """Load each unit in turn (reading the next ahead) and write it back after the caller used it."""
        if self.swapper is None:  # no optimizer attached yet: the masters are still in memory
            yield from units
            return
        for i, unit in enumerate(units):
            self._load(unit)
            self._prefetch(units[i + 1] if i + 1 < len(units) else None)
            yield unit
            self._store(unit)
        self._flush()

    def _prefetch(self, unit: Optional[Unit]) -> None:
        """Start reading ``unit`` into the pool buffers it will step in (no staging copy)."""
        if unit is None or unit.index in self._resident or unit.index in self._ahead or not self._swaps(unit):
            return
        self._finish_write(unit.index)
        assert self.swapper is not None  # resident() walks units only once attach() made it
        buffers = self._ahead[unit.index] = {}
        for name in self._names(unit):
            buffers[name] = self._pool.take(unit.layout.shard_numel)
            self.swapper.prefetch(swap_key(unit.index, name), out=buffers[name])

    def _names(self, unit: Unit) -> list[str]:
        return ["master", *(self.keys if unit.index in self._state_on_disk else [])]

    def _load(self, unit: Unit) -> None:
        """Make ``unit``'s master (and optimizer state) resident in host memory."""
        if unit.index in self._resident or not self._swaps(unit):
            return
        self._finish_write(unit.index)
        assert self.swapper is not None and self.optimizer is not None  # attach() set both
        buffers = self._ahead.pop(unit.index, {})
        for name in set(buffers) - set(self._names(unit)):  # read ahead before a loaded state replaced it
            self.swapper.read(swap_key(unit.index, name), buffers[name])
            self._pool.give(buffers.pop(name))
        for name in self._names(unit):
            if name not in buffers:
                buffers[name] = self._pool.take(unit.layout.shard_numel)
            self.swapper.read(swap_key(unit.index, name), buffers[name])  # completes a read-ahead into it
        unit.set_master(buffers["master"])
        for view, seg in zip(unit.segment_masters, unit.segments):
            state = self.optimizer.state.get(view)
            for key in self.keys:
                if state and key in state and key in buffers:
                    state[key].data = buffers[key][seg.shard_span]
        self._resident[unit.index] = buffers

    def _store(self, unit: Unit) -> None:
        """Start writing ``unit`` back (its buffers are released once the writes complete)."""
        buffers = self._resident.get(unit.index)
        if buffers is None:
            return
        assert self.swapper is not None and self.optimizer is not None  # _load() made the unit resident
        for key in self.keys:  # state created by this step lives in the optimizer's own tensors
            flat = buffers.get(key)
            for view, seg in zip(unit.segment_masters, unit.segments):
                state = self.optimizer.state.get(view)
                if state and key in state:
                    if flat is None:
                        flat = buffers[key] = self._pool.take(unit.layout.shard_numel)
                        flat.zero_()
                    target = flat[seg.shard_span]
                    if state[key].data_ptr() != target.data_ptr():
                        target.copy_(state[key])
        handles = [self.swapper.write_async(swap_key(unit.index, name), t) for name, t in buffers.items()]
        self._writing[unit.index] = (handles, list(buffers.values()))
        while len(self._writing) > WRITES_IN_FLIGHT:  # the oldest write's buffers go back to the pool
            self._finish_write(next(iter(self._writing)))
        if all(k in buffers for k in self.keys):
            self._state_on_disk.add(unit.index)
        self._evict(unit)

    def _evict(self, unit: Unit) -> None:
        self._resident.pop(unit.index, None)  # the writes in flight keep their own references
        unit.set_master(torch.empty(0))
        for view in unit.segment_masters:
            for key, value in self.optimizer.state.get(view, {}).items() if self.optimizer else ():
                if key in self.keys:
                    value.data = torch.empty(0)

    def _finish_write(self, index: int) -> None:
        handles, buffers = self._writing.pop(index, ([], []))
        for handle in handles:
            handle.wait()
        if buffers:  # back to the pool only once the device read the master (``published``) too
            self.wait_device_reads(index)
        for buffer in buffers:
            self._pool.give(buffer)

    def _flush(self) -> None:
        """Wait for every write-back; raise the first I/O error."""
        for index in list(self._writing):
            self._finish_write(index)
        assert self.swapper is not None  # resident() flushes only once attach() made it
        self.swapper.wait_all()

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
            self.swapper = None


class NvmeStore:
    """Stage 3 parameter offload to NVMe: each transient unit's payload in a swap region."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, numels: dict[int, int], *, nvme_path: str, rank: int
    ) -> None:
        self.device, self.dtype, self.pin = device, dtype, device.type == "cuda"
        self.numels = numels
        self._pool = BufferPool(dtype, self.pin)
        self.swapper = NvmeSwapper(nvme_path, rank=rank, prefix="zeroq_params", pin_memory=self.pin)
        for index, numel in numels.items():
            self.swapper.register(swap_key(index, "param"), numel, dtype)
        self.swapper.reserve()  # the free space for every region, checked before the first write
        self._lock = threading.Lock()
        """An asynchronous step publishes (``put``) on its worker while the forward gathers (``get``)."""

    def put(self, unit: Unit, payload: Tensor) -> None:
        with self._lock:
            self.swapper.write(swap_key(unit.index, "param"), payload.to("cpu", self.dtype))

    def get(self, unit: Unit) -> Tensor:
        with self._lock:
            source = self._pool.take(self.numels[unit.index])
            self.swapper.read(swap_key(unit.index, "param"), source)
            payload = source.to(self.device, non_blocking=True)
            self._pool.give(source)  # on the stream of the copy: reused once that copy is done
        return payload

    def device_tensors(self) -> list[Tensor]:
        return []

    def close(self) -> None:
        self.swapper.close()
