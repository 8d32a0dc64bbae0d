"""Unshard and reshard: the one place that writes a unit's working buffer.

A ``Gatherer`` combines four objects chosen when the engine is built: the *wire* (how a shard
travels: full width or INT8, ``wire.py``), the placement's *masters* role (where the master shards are,
``offload/roles.py``), for stage 3 the *shard store* (where a transient unit's payload rests between
gathers: the device, pinned host memory or NVMe, ``offload/``), and the host's *worker*
(``offload/host_worker.py``), whose work on a unit (an asynchronous step's publication) a gather waits for.

- ``publish(unit)`` after every step and checkpoint load: a persistent unit's working buffer is
  synced from the master shards (``wire.sync``) and its parameters' version counters are marked
  (``Unit.mark``: a write into them after this is one the masters have not seen, ``full_params.take_writes``); a transient unit's payload is re-encoded into the
  store (``wire.encode``), and the unit is freed if something had it gathered.
- ``gather(unit, prefetch)``, stage 3 before every use: wait for the worker's work on the unit (a
  prefetch of a unit it is still working on is left to the unit's use), re-allocate the storage of
  ``flat`` and fill it from every rank's payload. With ``prefetch`` on CUDA the copy from the store and
  the collective run on the gather stream, which first waits for the compute stream; the first real use
  waits for the recorded event. On CPU a "prefetch" is a synchronous gather done early.
- ``free(unit)``: drop the storage of ``flat`` again (after waiting for a prefetch in flight).
- Stage 3's frozen parts (``frozen.py``) have a ``Gatherer`` of their own (``frozen``): a unit's ``gather`` and
  ``free`` call it for the unit's frozen part first, so whatever gathers a unit gathers its frozen part.

Every rank must gather the same units in the same order (each gather is a collective). A module only
some ranks run (a branch on the rank or the data) breaks that, and the ranks then pair gathers of
different units (wrong weights, silently, where the sizes match) until they wait in different
collectives. Two things name it instead:

- Until stage 3 has learned the order (``checking``: until the first backward ends, at most
  ``4 x`` the transient units' gathers), each gather is preceded by a small all-gather of (gather
  number, unit): where the ranks differ, every rank raises the same ``RuntimeError`` naming the
  gather, the units and the ranks (``different_units``), before any wrong value travels.
- Afterwards (a branch on the data may first differ at any step) no collective is added:
  ``GATHERS`` records this process's gathers (how many, the last few units by name, the one in
  progress), which the watchdog (``common/watchdog.py``) publishes with each beat. When every rank has
  waited in a collective for a few seconds, it compares the ranks' records and ends the job on every
  rank with the first gather whose unit differs; a collective timeout names it the same way.

Lifetimes: see ``unit.py``; when a unit is gathered and freed is decided by ``stage3.py``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.offload.host_worker import HostWorker
from lightning_zeroq.zero.offload.roles import Masters
from lightning_zeroq.zero.offload.stores import ShardStore
from lightning_zeroq.zero.unit import Unit, UnitState
from lightning_zeroq.zero.wire import FullWidth, Wire


class GatherTrace:
    """This process's stage-3 gathers (collectives; see the module docstring): how many so far, the last
    ``KEEP`` units' names (the last one the latest), and the unit of the gather in progress (left set when
    a gather raises). One immutable tuple, replaced at each change, so another thread reads it whole."""

    KEEP = 8

    def __init__(self) -> None:
        self.state: tuple[int, tuple[str, ...], Optional[str]] = (0, (), None)

    @property
    def count(self) -> int:
        return self.state[0]

    def begin(self, name: str) -> None:
        n, last, _ = self.state
        self.state = (n + 1, (*last[len(last) - self.KEEP + 1 :], name), name)

    def end(self) -> None:
        n, last, _ = self.state
        self.state = (n, last, None)

    def snapshot(self) -> dict[str, Any]:
        """For the watchdog's beat: ``n`` gathers so far, the ``last`` units' names, the one gathered ``now``."""
        n, last, now = self.state
        return {"n": n, "last": list(last), "now": now}


GATHERS = GatherTrace()
"""The process's gathers, whatever engine issues them (every rank builds the same engines in the same order)."""


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def different_units(number: int, by_rank: Mapping[int, Optional[str]]) -> str:
    """The message for ranks whose gather ``number`` (counted from the first) gathered different units;
    ``by_rank``: each rank's unit name (None: that rank was not in a gather)."""
    groups: dict[Optional[str], list[int]] = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    what = "; ".join(
        f"{_ranks(ranks)} {'gathered ' + repr(name) if name is not None else 'did not gather any unit'}"
        for name, ranks in groups.items()
    )
    return (
        f"ZeroQ stage 3: the ranks ran different modules: at their stage-3 gather #{number}, {what}. Every rank must "
        "run the same stage-3 units in each forward (each gather is a collective): a module that only some ranks "
        "run (a branch on the rank or on the data) must not be a unit; leave its class out of stage3_wrap_classes "
        "(its parameters then stay gathered in the root unit), or run it on every rank"
    )


class Gatherer:
    def __init__(
        self,
        wire: Wire,
        masters: Masters,
        store: Optional[ShardStore],
        device: torch.device,
        worker: HostWorker,
        *,
        sync_persistent_on_build: bool,
    ) -> None:
        self.wire, self.masters, self.store, self.device, self.worker = wire, masters, store, device, worker
        self.sync_persistent_on_build = sync_persistent_on_build
        self._stream = comm.side_stream(device) if store is not None else None
        self.names: dict[int, str] = {}
        """Stage 3: each transient unit's name (its module's), for messages."""
        self.checking = 0
        """How many more gathers are checked against the other ranks' (see the module docstring)."""
        self._count = 0
        """The gathers (collectives) this gatherer issued."""
        self.frozen: Optional["Gatherer"] = None
        """Stage 3: the gatherer of the units' frozen parts (``frozen.py``), called for a unit's frozen part
        whenever this one gathers or frees the unit."""

    def adopt(self, unit: Unit) -> None:
        """A unit was just built (its working buffer holds rank 0's values at full width)."""
        if not unit.persistent:
            self.publish(unit)  # the payload goes to the store and the unit is freed at once
            return
        if self.sync_persistent_on_build:
            self.wire.sync(unit, self.masters)  # INT8: the working weights are what a gather produces
        unit.mark()

    @torch.no_grad()
    def publish(self, unit: Unit, spans: Optional[Sequence[slice]] = None) -> None:
        """Bring the working weights up to the masters after a step. ``spans``: only these parts of this
        rank's shard changed (``binding.stepped_spans``); a full-width persistent unit then sends only them."""
        if unit.persistent:
            if spans is not None and isinstance(self.wire, FullWidth):
                self.wire.sync_spans(unit, self.masters, spans)
            else:
                self.wire.sync(unit, self.masters)
            unit.mark()  # a write into the parameters from here on is one the masters have not seen
        else:
            assert self.store is not None
            self.store.put(unit, self.wire.encode(unit, self.masters))
            self.free(unit)  # gathered outside a step (e.g. a validation forward in progress)
        self.masters.published(unit)  # the copies reading a host master may still be running

    @torch.no_grad()
    def gather(self, unit: Unit, prefetch: bool = False) -> None:
        """Give a transient unit its full working buffer (a no-op if it has it)."""
        if unit.state is UnitState.SHARDED:
            if prefetch and self.worker.busy(unit.index):
                return  # a prefetch of a unit an asynchronous step has not published yet: gathered when used
            self.worker.wait(unit.index)
        if unit.frozen is not None and self.frozen is not None:
            self.frozen.gather(unit.frozen, prefetch)  # (freed on its own in a backward: ``Stage3Coordinator``)
        if unit.state is UnitState.GATHERED:
            return
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if unit.state is UnitState.PREFETCHING:
            if not prefetch:
                assert current is not None and unit.ready is not None  # prefetching happens on CUDA only
                current.wait_event(unit.ready)
                unit.ready, unit.state = None, UnitState.GATHERED
            return
        assert self.store is not None
        name = self.names.get(unit.index, f"unit {unit.index}")
        self._count += 1
        if self.checking > 0:
            self.checking -= 1
            self._check(unit)
        GATHERS.begin(name)  # ended below; left in progress if the gather raises (the watchdog names it)
        if self._stream is not None:
            # Allocated in the gather stream's pool: a freed working buffer then waits there for the next
            # gather, whole, instead of being cut up by the forward's activations on the compute stream
            # (which made the allocator reserve a new block for nearly every unit). Every write into a
            # reused buffer comes after the compute stream's uses of it: on the compute stream itself, or
            # on the gather stream after it waited for the compute stream (below).
            with torch.cuda.stream(self._stream):
                unit.restore_storage()
        else:
            unit.restore_storage()
        if prefetch and self._stream is not None:
            assert current is not None  # the side stream exists on CUDA only
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                self.wire.gather(unit, self.store.get(unit))
                unit.ready = torch.cuda.Event()
                unit.ready.record(self._stream)
            unit.state = UnitState.PREFETCHING
        else:
            self.wire.gather(unit, self.store.get(unit))
            unit.state = UnitState.GATHERED
        GATHERS.end()

    def _check(self, unit: Unit) -> None:
        """Every rank is about to gather this unit as the same gather, or every rank raises naming them."""
        group = self.wire.group
        if comm.alone(group):
            return
        _, world = rank_and_size(group)
        mine = torch.tensor([self._count, unit.index], dtype=torch.int64, device=self.device)
        rows = torch.empty(2 * world, dtype=torch.int64, device=self.device)
        comm.all_gather(rows, mine, group)
        seen = rows.view(world, 2).tolist()
        if all(index == unit.index for _, index in seen):
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        names = {ranks[r]: self.names.get(index, f"unit {index}") for r, (_, index) in enumerate(seen)}
        numbers = {n for n, _ in seen}
        if len(numbers) > 1:  # the ranks issued different numbers of gathers before this one
            names = {rank: f"{name} (as its gather #{n})" for (rank, name), (n, _) in zip(names.items(), seen)}
        raise RuntimeError(f"{different_units(min(numbers), names)} (rank {dist.get_rank()} stops here)")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def free(self, unit: Unit, frozen: bool = True) -> None:
        """Release a transient unit's full buffer (its parameters keep their shapes), and its frozen part's
        unless ``frozen=False``."""
        if frozen and unit.frozen is not None and self.frozen is not None:
            self.frozen.free(unit.frozen)
        if unit.persistent or unit.state is UnitState.SHARDED:
            return
        if unit.state is UnitState.PREFETCHING:  # prefetched and never used: let the gather finish
            assert unit.ready is not None  # recorded with the prefetch
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
            unit.ready = None
        unit.release_storage()
        unit.state = UnitState.SHARDED
