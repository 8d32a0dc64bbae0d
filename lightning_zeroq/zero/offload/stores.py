"""Where a stage-3 transient unit's payload (its working shard, or its INT8 encoding) rests between
gathers: ``put`` after each step, ``get`` (on the device, or pinned for the wire to copy) before each
gather. Every ``ShardStore`` but NVMe's (``nvme.NvmeStore``, beside the swap space it shares with the
NVMe optimizer) lives here; ``offload.shard_store`` chooses one from the ``Offload`` policy.

- ``MasterAlias`` (fp32) and ``CastMaster`` (bf16/fp16): the master on the device is the payload;
  nothing rests.
- ``DeviceStore``: the payload stays on the device (INT8, or a master off the device).
- ``HostStore``: parameter offload to CPU, the payload in pinned host memory (the host kernel writes
  the step's bf16 copy straight into it, ``host.HostOptimizer.store_built``).
- ``SplitStore``: partial optimizer offload, each unit served by one of the first two.

And the copies they make: ``host_copy`` (a pinned host copy) and ``copy_cast_to_device`` (host to
device in the source dtype, cast on the GPU).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_zeroq.swap.buffers import pinned_empty
from lightning_zeroq.zero.unit import Unit

CAST_CHUNK_NUMEL = 1 << 24
"""fp32 elements per host-to-device copy in ``copy_cast_to_device`` (64 MiB of device scratch)."""


def copy_cast_to_device(dst: Tensor, src: Tensor, chunk_numel: int = CAST_CHUNK_NUMEL) -> Tensor:
    """``dst`` (on a GPU) <- ``src`` (pinned host memory, another dtype), asynchronously: each chunk
    crosses PCIe in ``src``'s dtype into device scratch and is cast there. (``Tensor.copy_`` casts a
    host-to-device copy on the CPU, into pageable memory.) Everything runs on the current stream, so
    the scratch memory is reused in order. Returns ``dst``."""
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    for start in range(0, flat_src.numel(), chunk_numel):
        part = flat_src[start : start + chunk_numel].to(dst.device, non_blocking=True)
        flat_dst[start : start + part.numel()].copy_(part)
    return dst


def host_copy(tensor: Tensor, pin: bool, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A host copy of ``tensor`` (in ``dtype``, default its own), pinned where a GPU will copy from or
    to it (exactly its bytes: ``pinned_empty``)."""
    if not pin:
        return tensor.detach().to("cpu", dtype=dtype, copy=True)
    host = pinned_empty(tensor.numel(), dtype or tensor.dtype).view(tensor.shape)
    return host.copy_(tensor.detach())


class HostStore:
    """Stage 3 parameter offload to CPU: each transient unit's payload in a pinned host buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numels: dict[int, int]) -> None:
        self.device, self.pin = device, device.type == "cuda"
        self.buffers = {i: pinned_empty(n, dtype, self.pin) for i, n in numels.items()}

    def put(self, unit: Unit, payload: Tensor) -> None:
        buffer = self.buffers[unit.index]
        if payload.data_ptr() == buffer.data_ptr():
            return  # the host kernel wrote the step's payload here (``HostOptimizer.store_built``)
        if self.pin and payload.device.type == "cpu" and payload.dtype != buffer.dtype:
            # A host master (optimizer offload): cast on the GPU and copy the payload back, so the CPU,
            # which steps the next unit meanwhile, only enqueues copies (a cast of every master on the CPU
            # would sit in the step's critical path). Both casts round to nearest even.
            payload = copy_cast_to_device(torch.empty(payload.shape, dtype=buffer.dtype, device=self.device), payload)
        buffer.copy_(payload, non_blocking=True)

    def get(self, unit: Unit) -> Tensor:
        # The pinned buffer itself: the wire copies it to the device (at one rank in the shard group with
        # full-width shards, straight into the working buffer: no unit-sized device copy in between).
        return self.buffers[unit.index]

    def device_tensors(self) -> list[Tensor]:
        return []

    def close(self) -> None:
        pass


class ShardStore(Protocol):
    def put(self, unit: Unit, payload: Tensor) -> None: ...

    def get(self, unit: Unit) -> Tensor: ...

    def device_tensors(self) -> list[Tensor]: ...

    def close(self) -> None: ...


def freed_by_moving(store: Optional[ShardStore], index: int) -> int:
    """Device bytes ``store`` gives up when unit ``index``'s master comes to the device (a payload it
    keeps there only because the master was elsewhere), as the caching allocator counts them."""
    follows = getattr(store, "freed_by_moving", None)
    return follows(index) if follows is not None else 0


def master_moved(store: Optional[ShardStore], index: int) -> None:
    """Unit ``index``'s master is on the device now: ``store`` gathers from it (where it can)."""
    follow = getattr(store, "master_moved", None)
    if follow is not None:
        follow(index)


class MasterAlias:
    """Masters on the device, full width, and either fp32 working weights or one rank in the shard group
    (its gather is a copy, which casts): gathers read the master itself."""

    def put(self, unit: Unit, payload: Tensor) -> None:
        pass

    def get(self, unit: Unit) -> Tensor:
        return unit.master

    def device_tensors(self) -> list[Tensor]:
        return []  # the masters are counted as the optimizer placement's

    def close(self) -> None:
        pass


class CastMaster:
    """Working weights in bf16/fp16, masters on the device, full width: nothing rests between
    gathers; each gather casts this rank's fp32 master to the working dtype (as FSDP2 casts its
    sharded parameter at each all-gather). This saves the resting working-dtype copy a
    ``DeviceStore`` would keep (2 bytes per parameter / world size in bf16), for one temporary shard
    per gather in flight. Bitwise the same weights: a ``DeviceStore`` held ``master.to(dtype)`` too
    (its ``copy_`` rounds as ``to`` does), refreshed by the publish that follows every change of the
    master (a step, a load, a write-back), so its gathers read the current master's cast, as these do.

    Streams (CUDA). ``Gatherer.gather`` calls ``get`` inside ``torch.cuda.stream(s)`` when it
    prefetches, after ``s.wait_stream(compute)``: the cast is queued on ``s`` behind the step that
    wrote the master, and the caching allocator takes its output from ``s``'s pool (blocks belong to
    the stream current at allocation). The all-gather that reads it is issued on ``s`` too: NCCL's
    internal stream waits for ``s``, the process group keeps the input alive (record_stream or its
    stash), and a synchronous collective makes ``s`` wait for it before returning. When the
    temporary is dropped, its block goes back to ``s``'s pool and is handed out again only to work
    queued on ``s``, after the all-gather: no ``record_stream`` is needed. Without prefetch all of
    it runs on the compute stream. The master is read on ``s`` as ``MasterAlias`` reads it: every
    prefetched unit is waited for (used or freed) before the backward ends, so before the step
    writes the master; a prefetch still in flight when a step or load writes it (one left by an
    evaluation forward) is discarded, since the publish that follows frees the unit.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def put(self, unit: Unit, payload: Tensor) -> None:
        pass  # the master is the payload (publish still frees a gathered unit)

    def get(self, unit: Unit) -> Tensor:
        return unit.master.to(self.dtype)

    def device_tensors(self) -> list[Tensor]:
        return []  # only the temporary cast of a gather in flight; the masters are the placement's

    def close(self) -> None:
        pass


class DeviceStore:
    """The payload stays on the device, in one buffer per unit reused every step: the INT8 payload,
    or the working-dtype shard where the master is off the device (optimizer offload), so a gather
    does not fetch it across PCIe."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numels: dict[int, int]) -> None:
        self.buffers = {i: torch.empty(n, dtype=dtype, device=device) for i, n in numels.items()}

    def put(self, unit: Unit, payload: Tensor) -> None:
        buffer = self.buffers[unit.index]
        if payload.is_pinned() and buffer.device.type == "cuda" and payload.dtype != buffer.dtype:
            copy_cast_to_device(buffer, payload)  # a master on the host: cast on the GPU
        else:
            buffer.copy_(payload, non_blocking=True)

    def get(self, unit: Unit) -> Tensor:
        return self.buffers[unit.index]

    def drop(self, index: int) -> int:
        """Release unit ``index``'s buffer (another store serves it now); returns its allocated bytes."""
        buffer = self.buffers.pop(index)
        return -(-buffer.numel() * buffer.element_size() // 512) * 512

    def device_tensors(self) -> list[Tensor]:
        return list(self.buffers.values())

    def close(self) -> None:
        pass


class SplitStore:
    """Stage 3 with partial offload: the transient units whose master stays on the device gather from
    it (``on_device``: ``MasterAlias`` or ``CastMaster``, nothing resting), the others from the payload
    kept on the device (``off_device``: a ``DeviceStore`` of those units only). With
    ``offload_optimizer_ratio="auto"`` every unit starts off the device, and ``master_moved`` hands a unit
    whose master came back to ``on_device``, dropping its payload, as if its ratio had put it there."""

    def __init__(self, on_device: ShardStore, off_device: DeviceStore, device_units: frozenset[int]) -> None:
        self.on_device, self.off_device, self.device_units = on_device, off_device, set(device_units)

    def freed_by_moving(self, index: int) -> int:
        buffer = self.off_device.buffers.get(index)
        return 0 if buffer is None else -(-buffer.numel() * buffer.element_size() // 512) * 512

    def master_moved(self, index: int) -> None:
        if index in self.off_device.buffers:  # a transient unit (persistent ones are not in a store)
            self.off_device.drop(index)
            self.device_units.add(index)

    def _of(self, unit: Unit) -> ShardStore:
        return self.on_device if unit.index in self.device_units else self.off_device

    def put(self, unit: Unit, payload: Tensor) -> None:
        self._of(unit).put(unit, payload)

    def get(self, unit: Unit) -> Tensor:
        return self._of(unit).get(unit)

    def device_tensors(self) -> list[Tensor]:
        return self.on_device.device_tensors() + self.off_device.device_tensors()

    def close(self) -> None:
        self.on_device.close()
        self.off_device.close()
