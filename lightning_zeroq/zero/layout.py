"""Layout arithmetic for units and shards. Pure functions: no torch.distributed, no tensors.

A *unit* is a list of parameters flattened, in order, into one 1-D buffer. The buffer is padded with
zeros to a multiple of ``world_size * ALIGN`` and cut into ``world_size`` equal *shards*; rank ``r``
owns ``[r * shard_numel, (r + 1) * shard_numel)``. ``ALIGN`` is the quantization group size, so a
shard is always a whole number of groups.

A parameter may straddle shards. The part of parameter ``i`` inside rank ``r``'s shard is a
*segment*; the optimizer sees one fp32 master tensor per segment, so per-parameter optimizer state
(Adam's ``step``) and per-parameter skipping (unused parameters) work as with unsharded tensors.

Every slice of a flat buffer, a shard or a parameter that the engine takes is one of the ``span``
properties below, so the arithmetic lives here once.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

ALIGN = 64


class Slot(NamedTuple):
    """Where one parameter lives inside its unit's flat buffer."""

    offset: int
    numel: int

    @property
    def span(self) -> slice:
        """The parameter's elements in the flat buffer."""
        return slice(self.offset, self.offset + self.numel)


class Segment(NamedTuple):
    """The part of parameter ``param`` (index within the unit) that lies in one rank's shard."""

    param: int
    param_start: int
    """First element of the segment, counted within the parameter."""
    shard_start: int
    """First element of the segment, counted within the shard."""
    numel: int

    @property
    def shard_span(self) -> slice:
        """The segment's elements in the shard."""
        return slice(self.shard_start, self.shard_start + self.numel)

    @property
    def param_span(self) -> slice:
        """The segment's elements in the (flattened) parameter."""
        return slice(self.param_start, self.param_start + self.numel)


class UnitLayout(NamedTuple):
    slots: tuple[Slot, ...]
    numel: int
    """Elements that belong to parameters (the unpadded length)."""
    shard_numel: int
    world_size: int

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_span(self, rank: int) -> slice:
        """``rank``'s shard in the flat buffer."""
        return slice(*self.shard_range(rank))

    def segments(self, rank: int) -> list[Segment]:
        """The parameter segments inside ``rank``'s shard, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for index, slot in enumerate(self.slots):
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append(Segment(index, start - slot.offset, start - lo, end - start))
        return out


def make_layout(numels: Sequence[int], world_size: int, align: int = ALIGN) -> UnitLayout:
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1.")
    slots, offset = [], 0
    for numel in numels:
        slots.append(Slot(offset, numel))
        offset += numel
    chunk = world_size * align
    padded = max(chunk, -(-offset // chunk) * chunk)
    return UnitLayout(tuple(slots), offset, padded // world_size, world_size)


def plan_units(numels: Sequence[int], bound: int) -> list[list[int]]:
    """Group consecutive parameter indices into units of at most ``bound`` elements.

    A parameter larger than ``bound`` gets a unit of its own (a parameter is never split across units).
    """
    units: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, numel in enumerate(numels):
        if current and size + numel > bound:
            units.append(current)
            current, size = [], 0
        current.append(index)
        size += numel
    if current:
        units.append(current)
    return units
