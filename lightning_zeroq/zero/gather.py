"""Unshard and reshard: the one place that writes a unit's working buffer.

A ``Gatherer`` combines three objects chosen when the engine is built: the *wire* (how a shard
travels: full width or INT8, ``wire.py``), the placement's *masters* role (where the master shards are,
``offload/roles.py``) and, for stage 3, the *shard store* (where a transient unit's payload rests between
gathers: the device, pinned host memory or NVMe, ``offload/``).

- ``publish(unit)`` after every step and checkpoint load: a persistent unit's working buffer is
  synced from the master shards (``wire.sync``) and its parameters' version counters are marked
  (``Unit.mark``: a write into them after this is one the masters have not seen, ``access.take_writes``); a transient unit's payload is re-encoded into the
  store (``wire.encode``), and the unit is freed if something had it gathered.
- ``gather(unit, prefetch)``, stage 3 before every use: re-allocate the storage of ``flat`` and fill
  it from every rank's payload. With ``prefetch`` on CUDA the copy from the store and the collective
  run on the gather stream, which first waits for the compute stream; the first real use waits for
  the recorded event. On CPU a "prefetch" is a synchronous gather done early.
- ``free(unit)``: drop the storage of ``flat`` again (after waiting for a prefetch in flight).

Lifetimes: see ``unit.py``; when a unit is gathered and freed is decided by ``stage3.py``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lightning_zeroq.zero import comm
from lightning_zeroq.zero.offload import ShardStore
from lightning_zeroq.zero.offload.roles import Masters
from lightning_zeroq.zero.unit import Unit, UnitState
from lightning_zeroq.zero.wire import Wire


class Gatherer:
    def __init__(
        self,
        wire: Wire,
        masters: Masters,
        store: Optional[ShardStore],
        device: torch.device,
        *,
        sync_persistent_on_build: bool,
    ) -> None:
        self.wire, self.masters, self.store, self.device = wire, masters, store, device
        self.sync_persistent_on_build = sync_persistent_on_build
        self._stream = comm.side_stream(device) if store is not None else None
        self._ready: Optional[Callable[[int, bool], bool]] = None

    def wait_with(self, ready: Callable[[int, bool], bool]) -> None:
        """An asynchronous step (``offload/ahead.py``) asks to be asked before a gather of unit i (prefetch
        or not): ``ready`` publishes the unit first, or declines a prefetch of one not stepped yet."""
        self._ready = ready

    def adopt(self, unit: Unit) -> None:
        """A unit was just built (its working buffer holds rank 0's values at full width)."""
        if not unit.persistent:
            self.publish(unit)  # the payload goes to the store and the unit is freed at once
            return
        if self.sync_persistent_on_build:
            self.wire.sync(unit, self.masters)  # INT8: the working weights are what a gather produces
        unit.mark()

    @torch.no_grad()
    def publish(self, unit: Unit) -> None:
        if unit.persistent:
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
        if unit.state is UnitState.GATHERED:
            return
        if unit.state is UnitState.SHARDED and self._ready is not None and not self._ready(unit.index, prefetch):
            return  # a prefetch of a unit an asynchronous step has not stepped yet: gathered when used
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if unit.state is UnitState.PREFETCHING:
            if not prefetch:
                assert current is not None and unit.ready is not None  # prefetching happens on CUDA only
                current.wait_event(unit.ready)
                unit.ready, unit.state = None, UnitState.GATHERED
            return
        assert self.store is not None
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

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def free(self, unit: Unit) -> None:
        """Release a transient unit's full buffer (its parameters keep their shapes)."""
        if unit.persistent or unit.state is UnitState.SHARDED:
            return
        if unit.state is UnitState.PREFETCHING:  # prefetched and never used: let the gather finish
            assert unit.ready is not None  # recorded with the prefetch
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
            unit.ready = None
        unit.release_storage()
        unit.state = UnitState.SHARDED


