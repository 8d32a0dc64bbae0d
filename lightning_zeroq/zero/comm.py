"""Collectives used by the engine, with the version and backend differences hidden.

- torch 2.13 deprecates ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` in favour of
  ``reduce_scatter_single`` / ``all_gather_single``; torch 2.11 (our GPU machine) only has the
  former. Same arguments; we take whichever exists.
- Reductions use SUM and the caller divides, because AVG is NCCL-only.
- Whether a backend has the flat-tensor collectives is decided once per backend from what is known
  of it (NCCL always; gloo from torch 2.8, pytorch#149869), never by catching an error: a timeout or
  a peer's failure must surface, not switch every later collective to a slower path. Gloo before
  2.8 uses ``all_reduce`` + slicing and a list ``all_gather``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zeroq.ranks import agree, is_distributed, rank_and_size

_reduce_scatter_impl = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_impl = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _backend(group: Optional[dist.ProcessGroup]) -> str:
    return str(dist.get_backend(group))


def has_flat_collectives(backend: str, torch_version: tuple[int, ...] = _TORCH) -> bool:
    """Does ``backend`` implement ``reduce_scatter_tensor`` and ``all_gather_into_tensor``?"""
    return backend != "gloo" or torch_version >= (2, 8)


def alone(group: Optional[dist.ProcessGroup]) -> bool:
    """No other rank in ``group`` (or no process group): a collective on it is a copy at most."""
    return rank_and_size(group)[1] == 1


def reduce_scatter(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """``output = sum over ranks of input``, this rank's chunk. ``input`` is ``world_size`` chunks long.
    One rank: a copy on the current stream, not a collective (bitwise the same)."""
    if alone(group):
        output.copy_(input)
        return
    if has_flat_collectives(_backend(group)):
        _reduce_scatter_impl(output, input, op=dist.ReduceOp.SUM, group=group)
        return
    summed = input.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    rank, n = dist.get_rank(group), output.numel()
    output.copy_(summed[rank * n : (rank + 1) * n])


def all_gather(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """``output`` = the ranks' ``input`` tensors concatenated in rank order (one rank: a copy)."""
    if alone(group):
        output.copy_(input)
        return
    if has_flat_collectives(_backend(group)):
        _all_gather_impl(output, input, group=group)
    else:
        dist.all_gather(list(output.chunk(dist.get_world_size(group))), input, group=group)


def all_gather_uneven(output: Tensor, input: Tensor, counts: list[int], group: Optional[dist.ProcessGroup]) -> None:
    """``output`` = the ranks' ``input`` tensors concatenated in rank order, where rank ``r`` sends
    ``counts[r]`` elements (no padding to the largest): an all-to-all with split sizes, in which each
    rank sends its values to every rank (the same bytes on the wire as a ring all-gather of them)."""
    world = len(counts)
    all_to_all_uneven(output, input.repeat(world) if world > 1 else input, counts, [input.numel()] * world, group)


def all_to_all_uneven(
    output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int], group: Optional[dist.ProcessGroup]
) -> None:
    """Split sizes of one's own: ``input_splits[r]`` elements of ``input`` go to rank ``r``, and
    ``output_splits[r]`` of ``output`` come from it (one rank: a copy)."""
    if len(input_splits) == 1 or not is_distributed():
        output.copy_(input)
        return
    dist.all_to_all_single(
        output, input, output_split_sizes=list(output_splits), input_split_sizes=list(input_splits), group=group
    )


def all_to_all(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Equal split sizes: rank ``r``'s ``i``-th chunk of ``input`` lands in rank ``i``'s ``r``-th chunk of ``output``."""
    dist.all_to_all_single(output, input, group=group)


def all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: Optional[dist.ProcessGroup]) -> None:
    dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: Tensor, src_rank: int, group: Optional[dist.ProcessGroup]) -> None:
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_rank) if group is not None else src_rank, group=group)


def duplicate(
    group: Optional[dist.ProcessGroup], world_group: Optional[dist.ProcessGroup]
) -> Optional[dist.ProcessGroup]:
    """A new group of the same ranks as ``group`` (one of the consecutive, equal groups ``world_group``
    is cut into), for collectives issued from another thread: their order then never interleaves with
    the calling thread's, as each group keeps its own. Every rank of the default group calls it: the
    groups are made in the same order everywhere, each under a name of its own. Without a process group,
    or with one rank, there is nothing to communicate: ``group`` itself."""
    if alone(group):
        return group
    everyone = list(range(dist.get_world_size()))
    world = dist.get_process_group_ranks(world_group) if world_group is not None else everyone
    mine = dist.get_process_group_ranks(group) if group is not None else everyone
    if world != everyone:  # a group of part of the job: only its ranks make the copy
        return dist.new_group(ranks=mine, use_local_synchronization=True)
    made = None
    for start in range(0, len(world), len(mine)):
        ranks = world[start : start + len(mine)]
        copy = dist.new_group(ranks=ranks)
        if ranks == mine:
            made = copy
    assert made is not None, (mine, world)  # shard groups are consecutive ranks (hybrid.py)
    return made


def side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


class _ArrayInterface:
    """What ``torch.as_tensor`` reads to wrap foreign CUDA memory (the CUDA array interface, v3)."""

    def __init__(self, host: Tensor) -> None:
        self.host = host  # kept alive as long as the alias
        typestr = {torch.bool: "|b1", torch.float32: "<f4", torch.uint8: "|u1", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def device_alias(host: Tensor) -> Tensor:
    """A CUDA tensor over the pinned host tensor ``host``: under unified addressing a pinned buffer's
    device address is its host address, so a kernel writing the alias stores straight into host
    memory over PCIe, with no copy engine involved (a copy to the host would queue behind every
    copy already issued, whatever its stream: ``benchmarks/kernels.py readback``). The host reads
    ``host`` once an event recorded after that kernel completed."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("device_alias needs a contiguous pinned host tensor")
    return torch.as_tensor(_ArrayInterface(host))


_MAPPED: dict[int, bool] = {}


def mapped_readback(device: torch.device) -> bool:
    """Whether ``HostFlags`` reads back through mapped host memory on ``device`` (checked once per
    device: a pinned buffer is wrapped and written by a kernel); otherwise it copies, through the copy
    engine, and the read-back waits for the copies to the host queued before it."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MAPPED:
        try:
            with torch.cuda.device(index):
                host = torch.zeros(4, dtype=torch.bool).pin_memory()
                torch.gt(torch.ones(4, device="cuda"), 0, out=device_alias(host))
                torch.cuda.synchronize()
                _MAPPED[index] = bool(host.all())
        except (RuntimeError, TypeError, ValueError):
            _MAPPED[index] = False
    return _MAPPED[index]


class HostFlags:
    """Reads small results back to the host: through mapped host memory where ``mapped_readback``
    (a kernel stores the result into a pinned buffer; an event after it says it is there), else with
    a copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}

    def positive(self, values: Tensor) -> Tensor:
        """``values > 0`` (1-D, on the device) as a bool tensor on the host."""
        if not mapped_readback(self.device):
            return (values > 0).cpu()
        n = values.numel()
        if n not in self._buffers:
            with torch.cuda.device(self.device):
                host = torch.zeros(n, dtype=torch.bool).pin_memory()
                self._buffers[n] = (host, device_alias(host))
        host, alias = self._buffers[n]
        if alias.device != values.device:  # the buffer belongs to another device's context
            return (values > 0).cpu()
        torch.gt(values, 0, out=alias)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()
        return host.clone()


class SideStream:
    """A CUDA stream that runs collectives beside the compute stream (``enabled`` and on CUDA); on
    CPU, or disabled, every call is a no-op and the work runs in order on the caller's stream."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.stream = side_stream(device) if enabled else None

    def context(self) -> contextlib.AbstractContextManager:
        """Enter the side stream, after everything the compute stream issued so far."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def keep_alive(self, tensor: Tensor) -> None:
        """``tensor`` is read on the side stream: the allocator must not reuse it before that is done."""
        if self.stream is not None:
            tensor.record_stream(self.stream)

    def join(self) -> None:
        """The compute stream waits for everything issued on the side stream so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


@contextlib.contextmanager
def agreed(group: Optional[dist.ProcessGroup], what: str) -> Iterator[None]:
    """Every rank leaves the block together. Wrap rank-local work that can fail on one rank only (a
    file, a path, a disk, a compiler) and comes before collectives: if the block raised on any rank,
    it raises on every rank (the failing rank re-raises its own error, the others a ``RuntimeError``
    naming it and its message), instead of one rank stopping while the others wait in a collective
    until the timeout (``lightning_zeroq.ranks.agree``, quick: one small all-reduce when all is well)."""
    error: Optional[BaseException] = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001  (re-raised below, on every rank)
        error = caught
    said = [] if error is None else [f"{type(error).__name__}: {error}"]

    def failure(errors: list[list[str]]) -> RuntimeError:
        failed = [r for r, errs in enumerate(errors) if errs]
        return RuntimeError(f"rank(s) {failed} failed while {what}; rank {failed[0]} said: {errors[failed[0]][0]}")

    agree(said, group, failure, own=error, quick=True)
