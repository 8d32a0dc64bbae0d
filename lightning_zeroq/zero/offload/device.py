"""No offload: master shards, optimizer state and stage-3 parameter shards on the compute device.

Two small protocols live here, because the device placement is also their base and default:

``OptimizerPlacement``: where the fp32 master shards and the optimizer state live and where the
optimizer step runs. The engine calls it at fixed points of a step and never asks which placement
it has:

- ``adopt_master`` (build): take this rank's fp32 shard, return the master to keep;
  ``master_on_device``: whether a unit's master stays on the device (the stage-3 store reads it there);
- ``attach`` (``attach_optimizer``): the optimizer is bound to the master segments;
  ``state_loaded``: its state was just loaded from a checkpoint; ``optimizer_replaced``: a twin holds it;
- ``begin_backward`` (``last``: the caller said a step follows this backward); ``grad_reduced``
  (backward, on the reduction stream): a unit's gradient just grew (offload: copy it to the host now
  if the backward is the last);
- ``gradients_ready`` (finalize, every reduction issued, before the agreement) and ``gradients_done``
  (after the agreement was read back): every gradient shard is final (offload: copy the rest to the
  host, before the read-back where it is mapped and waits for no copy, else after it);
- ``resident`` (publish, state dicts): the units in order, each with its master (and state) readable
  while the caller holds it; ``step_batches`` (step): the units in the batches the optimizer
  steps (all units at once on the device; one unit at a time with offload, in reverse order as the
  gradients left the device, so the copy back and gather of one unit overlap the host update of the
  next, and NVMe needs only a few resident); the order must be the same on every rank;
- ``scale_grads`` (unscaling and clipping, before the step): multiply parts of a unit's gradient (the
  host kernel applies it as it steps instead); ``step_batch``: step a batch itself, or leave it to
  ``optimizer.step()`` (offload: the host kernel, for torch's Adam/AdamW);
- ``step_grad``: the gradient shard the optimizer reads (offload: after its copy finished);
  ``device_master``/``device_working``: the master as fp32 or working dtype on the device, for the wire;
  ``host_working``: the working-dtype copy of a host master the step wrote, if fresh (stage 3's payload);
  ``store_built``: the stage-3 store (a host store's buffers are where that copy is written; ``auto``
  moves units within a split store);
- ``published`` (after ``Gatherer.publish`` issued the copies that read the unit's master): a host
  master must not be written, or its buffer reused, before they ran;
- ``end_window``, ``close``.

``ShardStore``: where a stage-3 transient unit's payload (its working shard, or its INT8 encoding)
rests between gathers: ``put`` after each step, ``get`` (on the device) before each gather. Where the
payload is the device master itself, nothing rests: ``MasterAlias`` (fp32) hands the master over,
``CastMaster`` (bf16/fp16) casts it at each gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, Sequence

import torch
from torch import Tensor

from lightning_zeroq.zero.unit import Unit

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_zeroq.zero.optimizers import Binding


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


class OptimizerPlacement:
    """Masters and optimizer state on the compute device; the optimizer steps all units at once."""

    masters_may_move = False
    """Masters come to the device after the engine is built (``auto.AutoSplit``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def adopt_master(self, index: int, shard: Tensor) -> Tensor:
        return shard.clone()

    def master_on_device(self, index: int) -> bool:
        """Unit ``index``'s master stays on the compute device (so stage 3 can gather from it)."""
        return True

    def attach(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass

    def state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def optimizer_replaced(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        """``new`` holds ``old``'s state from now on (``release_module`` handed ``old`` back to the user)."""

    def step_done(self, units: Sequence[Unit], optimizers: Sequence[torch.optim.Optimizer], stepped: bool,
                  group: Optional["dist.ProcessGroup"]) -> None:
        """After a step and the window's end (``stepped``: the optimizer ran). ``auto.AutoSplit`` decides here."""

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        yield from units

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        yield list(units)

    def begin_backward(self, last: bool) -> None:
        pass

    def grad_reduced(self, unit: Unit) -> None:
        pass

    def gradients_ready(self, units: Sequence[Unit]) -> None:
        pass

    def gradients_done(self, units: Sequence[Unit]) -> None:
        pass

    def step_grad(self, unit: Unit) -> Tensor:
        return unit.grad

    def scale_grads(self, unit: Unit, spans: Sequence[slice], multiplier: float) -> None:
        grad = self.step_grad(unit)
        for span in spans:
            grad[span].mul_(multiplier)

    def step_batch(self, batch: Sequence[Unit], binding: "Binding", used: Sequence[Any]) -> bool:
        """Step ``batch`` here (True), or leave it to the optimizer's own ``step()`` (False)."""
        return False

    def host_working(self, unit: Unit, dtype: torch.dtype) -> Optional[Tensor]:
        return None

    def store_built(self, store: ShardStore) -> None:
        """Stage 3's shard store, once built (a host store's buffers take the host step's bf16 copies;
        ``auto.AutoSplit`` moves units within a split store)."""

    def device_master(self, unit: Unit) -> Tensor:
        return unit.master

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        return unit.master.to(dtype)

    def published(self, unit: Unit) -> None:
        pass

    def end_window(self) -> None:
        pass

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
    """fp32 working weights and masters on the device, full width: gathers read the master itself."""

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
