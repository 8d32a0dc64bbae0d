"""Optimizer offload to NVMe: each unit's fp32 master shard and per-element optimizer state live in
swap files between steps and in host memory only while that unit steps.

Regions (one file each, ``NvmeSwapper``): ``u<i>.master`` and ``u<i>.<key>`` for every per-element
state key of the optimizer (``exp_avg``, ``exp_avg_sq`` for AdamW). The keys are found up front by
stepping a throw-away copy of the optimizer on a small tensor, so every region is registered, and the
free space checked, before training starts. Scalar state (Adam's ``step``) stays in memory.

Residency. The optimizer keeps its own tensor objects (its parameters are the master segments, its
state tensors hang off them); loading a unit points their ``.data`` at fresh host buffers read from
disk, storing it writes the buffers back and points ``.data`` at empty placeholders. The step walks
the units in order: unit ``i+1`` is read ahead while unit ``i`` steps, and unit ``i`` is written back
while ``i+1`` steps, so at most three units are resident. An I/O error, a short read or a swap file
that changed size raises ``RuntimeError`` naming the file before any step runs on the data.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import Tensor

from lightning_zeroq.swap.nvme import NvmeSwapper, SwapHandle, aligned_empty

if TYPE_CHECKING:
    from lightning_zeroq.zero.engine import _Unit


def per_element_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The state keys whose tensors have one element per parameter element, for this optimizer."""
    probe = torch.zeros(16, requires_grad=True)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    twin = type(optimizer)([probe], **{k: v for k, v in group.items() if k in accepted and k != "params"})
    probe.grad = torch.ones_like(probe)
    twin.step()
    return sorted(k for k, v in twin.state[probe].items() if isinstance(v, Tensor) and v.numel() == probe.numel())


class NvmeOptimizerState:
    def __init__(
        self, nvme_path: str, rank: int, units: list["_Unit"], optimizer: torch.optim.Optimizer, pin: bool
    ) -> None:
        self.optimizer = optimizer
        self.keys = per_element_state_keys(optimizer)
        self.pin = pin
        self.swapper = NvmeSwapper(nvme_path, rank=rank, pin_memory=pin)
        for unit in units:
            for name in ["master", *self.keys]:
                self.swapper.register(self._key(unit, name), unit.layout.shard_numel, torch.float32)
        self.swapper.reserve()  # checks the free space for every region before anything is written
        self._state_on_disk: set[int] = set()
        self._resident: dict[int, dict[str, Tensor]] = {}
        self._writing: dict[int, list[SwapHandle]] = {}
        for unit in units:
            self.swapper.write(self._key(unit, "master"), unit.master)
            self._evict(unit)

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` from now on; its in-memory state (empty, or just loaded from a checkpoint)
        replaces the state on disk as each unit is next stored."""
        self.optimizer = optimizer
        self._state_on_disk.clear()

    @staticmethod
    def _key(unit: "_Unit", name: str) -> str:
        return f"u{unit.index}.{name}"

    def _placeholder(self) -> Tensor:
        return torch.empty(0)

    def prefetch(self, unit: Optional["_Unit"]) -> None:
        if unit is None or unit.index in self._resident:
            return
        self._finish_write(unit)
        names = ["master", *(self.keys if unit.index in self._state_on_disk else [])]
        for name in names:
            self.swapper.prefetch(self._key(unit, name))

    def load(self, unit: "_Unit") -> None:
        """Make ``unit``'s master (and optimizer state) resident in host memory."""
        if unit.index in self._resident:
            return
        self._finish_write(unit)
        buffers: dict[str, Tensor] = {}
        for name in ["master", *(self.keys if unit.index in self._state_on_disk else [])]:
            buffers[name] = aligned_empty(unit.layout.shard_numel, torch.float32, pin_memory=self.pin)
            self.swapper.read(self._key(unit, name), buffers[name])
        unit.master = buffers["master"]
        for seg_master, seg in zip(unit.segment_masters, unit.segments):
            seg_master.data = buffers["master"][seg.shard_start : seg.shard_start + seg.numel]
            state = self.optimizer.state.get(seg_master)
            for key in self.keys:
                if state and key in state and key in buffers:
                    state[key].data = buffers[key][seg.shard_start : seg.shard_start + seg.numel]
        self._resident[unit.index] = buffers

    def store(self, unit: "_Unit") -> None:
        """Start writing ``unit`` back (its buffers are released once the writes complete)."""
        buffers = self._resident.get(unit.index)
        if buffers is None:
            return
        for key in self.keys:  # state created by this step lives in the optimizer's own tensors
            flat = buffers.get(key)
            for seg_master, seg in zip(unit.segment_masters, unit.segments):
                state = self.optimizer.state.get(seg_master)
                if state and key in state:
                    if flat is None:
                        flat = buffers[key] = aligned_empty(unit.layout.shard_numel, torch.float32, pin_memory=self.pin)
                        flat.zero_()
                    target = flat[seg.shard_start : seg.shard_start + seg.numel]
                    if state[key].data_ptr() != target.data_ptr():
                        target.copy_(state[key])
        handles = [self.swapper.write_async(self._key(unit, name), t) for name, t in buffers.items()]
        if all(k in buffers for k in self.keys):
            self._state_on_disk.add(unit.index)
        self._writing[unit.index] = handles
        self._evict(unit)

    def _evict(self, unit: "_Unit") -> None:
        self._resident.pop(unit.index, None)  # the writes in flight keep their own references
        unit.master = self._placeholder()
        for seg_master in unit.segment_masters:
            seg_master.data = self._placeholder()
            for key, value in self.optimizer.state.get(seg_master, {}).items():
                if key in self.keys:
                    value.data = self._placeholder()

    def _finish_write(self, unit: "_Unit") -> None:
        for handle in self._writing.pop(unit.index, []):
            handle.wait()

    def flush(self) -> None:
        """Wait for every write-back; raise the first I/O error."""
        for index in list(self._writing):
            for handle in self._writing.pop(index):
                handle.wait()
        self.swapper.wait_all()

    def resident(self, units: list["_Unit"]) -> Iterator["_Unit"]:
        """Load each unit in turn (reading the next ahead) and write it back after the caller used it."""
        for i, unit in enumerate(units):
            self.load(unit)
            self.prefetch(units[i + 1] if i + 1 < len(units) else None)
            yield unit
            self.store(unit)
        self.flush()

    def close(self) -> None:
        self.swapper.close()
