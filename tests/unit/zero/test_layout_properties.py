"""Property-based tests (hypothesis) of the engine's pure arithmetic, for world sizes 1 to 1024.

- ``layout.make_layout``: padding, equal shards, every parameter element owned by exactly one rank's
  segment, and every ``span`` property consistent with the offsets (checked on real tensors).
- ``layout.plan_units``: order, the bound, greedy packing.
- ``wire.plan_chunks`` and ``Int8``'s per-unit plan: whole groups, the bucket bound counted across
  ranks, chunks that cover the shard exactly, payload offsets.
- ``wire.side_positions`` and the side plan: exactly the elements of small parameters in a shard;
  the gathered side buffer puts every exact value back where it came from.
- The whole INT8 wire (encode, chunked gathers, side channel) simulated in one process for a whole
  world of ranks: every rank ends with the reference's reconstruction, bit for bit.

Examples are derandomized (the same on every run) and bounded so the file runs in a few seconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from unittest import mock

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_zeroq import ops
from lightning_zeroq.ops import reference
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import ALIGN, make_layout, plan_units
from lightning_zeroq.zero.wire import Int8, _side_plan, plan_chunks, side_positions

FAST = settings(derandomize=True, max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOWER = settings(derandomize=True, max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# World sizes 1..1024, with the edges (powers of two and their neighbours) drawn often.
world_sizes = st.one_of(
    st.sampled_from([1, 2, 3, 7, 8, 9, 63, 64, 65, 127, 128, 129, 1000, 1023, 1024]),
    st.integers(1, 1024),
)
# Group sizes the config accepts (positive multiples of 8); the engine aligns layouts to lcm(64, group).
group_sizes = st.one_of(st.sampled_from([8, 64, 128]), st.integers(1, 32).map(lambda k: 8 * k))
# Parameter sizes: norms and biases, matrices, a few large ones, and the occasional empty parameter.
param_numels = st.one_of(st.integers(0, 130), st.integers(0, 5_000), st.integers(0, 300_000))
numel_lists = st.lists(param_numels, min_size=1, max_size=12)


def _owned_intervals(layout) -> list[tuple[int, int, int]]:
    """Every segment as ``(flat start, flat end, rank)``, checking on the way that it lies inside its
    shard and its parameter, that its two coordinates name the same element, and flat order."""
    out = []
    for rank in range(layout.world_size):
        lo, hi = layout.shard_range(rank)
        last = -1
        for seg in layout.segments(rank):
            slot = layout.slots[seg.param]
            assert seg.numel > 0
            assert seg.param > last, "segments in flat (parameter) order, one per parameter"
            last = seg.param
            assert 0 <= seg.shard_start and seg.shard_start + seg.numel <= hi - lo, "inside the shard"
            assert 0 <= seg.param_start and seg.param_start + seg.numel <= slot.numel, "inside the parameter"
            assert lo + seg.shard_start == slot.offset + seg.param_start, "both coordinates: one element"
            assert seg.shard_span == slice(seg.shard_start, seg.shard_start + seg.numel)
            assert seg.param_span == slice(seg.param_start, seg.param_start + seg.numel)
            out.append((lo + seg.shard_start, lo + seg.shard_start + seg.numel, rank))
    return out


@FAST
@given(numels=numel_lists, world_size=world_sizes, group=group_sizes)
def test_layout_pads_minimally_and_shards_equally(numels, world_size, group):
    align = math.lcm(ALIGN, group)
    layout = make_layout(numels, world_size, align)
    chunk = world_size * align
    total = sum(numels)
    assert layout.numel == total and layout.world_size == world_size
    assert layout.padded_numel == layout.shard_numel * world_size
    assert layout.padded_numel % chunk == 0 and layout.shard_numel % align == 0  # shards are whole groups
    assert layout.padded_numel >= max(total, chunk)
    assert layout.padded_numel - total < chunk or total == 0, "no more padding than one multiple needs"
    # Slots: consecutive, in order, ending at the unpadded length: padding is never inside a slot.
    offset = 0
    for slot, numel in zip(layout.slots, numels):
        assert slot.offset == offset and slot.numel == numel
        assert slot.span == slice(offset, offset + numel)
        offset += numel
    assert offset == layout.numel <= layout.padded_numel
    # Shards: equal, consecutive, covering the padded buffer.
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        assert (lo, hi) == (rank * layout.shard_numel, (rank + 1) * layout.shard_numel)
        assert layout.shard_span(rank) == slice(lo, hi)
    assert layout.shard_range(world_size - 1)[1] == layout.padded_numel


@FAST
@given(numels=numel_lists, world_size=world_sizes)
def test_every_parameter_element_is_owned_by_exactly_one_rank(numels, world_size):
    layout = make_layout(numels, world_size)
    intervals = _owned_intervals(layout)
    assert intervals == sorted(intervals), "ranks' segments follow each other in flat order"
    end = 0
    for start, stop, rank in intervals:  # back to back from 0: no element owned twice, none missed
        assert start == end, (start, end)
        assert stop <= layout.shard_range(rank)[1], "owned by the rank whose shard holds it"
        end = stop
    assert end == layout.numel, "parameters end where padding starts; padding belongs to no segment"
    for slot in layout.slots:  # and every parameter is covered from its first to its last element
        pieces = [(a, b) for a, b, _ in intervals if slot.offset <= a < slot.offset + slot.numel]
        assert sum(b - a for a, b in pieces) == slot.numel


@SLOWER
@given(numels=st.lists(st.integers(0, 3_000), min_size=1, max_size=10), world_size=world_sizes)
def test_spans_slice_the_same_elements_out_of_real_tensors(numels, world_size):
    # The engine only ever slices through these properties: check them as slices of real buffers.
    layout = make_layout(numels, world_size)
    flat = torch.arange(layout.padded_numel)
    params = [flat[slot.span] for slot in layout.slots]
    assert [p.numel() for p in params] == list(numels)
    for rank in range(world_size):
        shard = flat[layout.shard_span(rank)]
        assert shard.numel() == layout.shard_numel
        segs = layout.segments(rank)
        for seg in segs:
            assert torch.equal(shard[seg.shard_span], params[seg.param][seg.param_span])
        # everything in the shard outside the segments is padding
        in_segments = sum(seg.numel for seg in segs)
        lo, hi = layout.shard_range(rank)
        assert in_segments == max(0, min(hi, layout.numel) - lo)


@FAST
@given(numels=st.lists(st.integers(0, 1_000), min_size=0, max_size=40), data=st.data())
def test_plan_units_keeps_order_and_the_bound(numels, data):
    # Bounds that some run of parameters fills exactly are drawn often: the edge of "at most".
    fills = sorted({sum(numels[i:j]) for i in range(len(numels)) for j in range(i + 1, min(i + 4, len(numels)) + 1)} - {0})
    bound = data.draw(st.one_of(st.integers(1, 50), st.integers(1, 5_000), *([st.sampled_from(fills)] if fills else [])),
                      label="bound")
    units = plan_units(numels, bound)
    assert [i for unit in units for i in unit] == list(range(len(numels))), "order, each parameter once"
    assert all(unit for unit in units)
    for unit in units:
        size = sum(numels[i] for i in unit)
        assert size <= bound or (len(unit) == 1 and numels[unit[0]] > bound), "bound, or one oversize alone"
    for a, b in zip(units, units[1:]):  # greedy: a unit closes only when the next parameter does not fit
        assert sum(numels[i] for i in a) + numels[b[0]] > bound


@FAST
@given(shard_groups=st.one_of(st.integers(0, 20), st.integers(0, 1_000_000)), world_size=world_sizes,
       bucket=st.one_of(st.integers(1, 4096), st.integers(1, 10**6), st.integers(1, 10**9)), group=group_sizes)
def test_chunk_plan_bounds_every_collective_and_covers_the_shard(shard_groups, world_size, bucket, group):
    shard = shard_groups * group
    chunk, num_chunks = plan_chunks(shard, world_size, bucket, group)
    assert chunk % group == 0 and chunk >= group, "whole groups, at least one per rank"
    assert chunk * world_size <= max(bucket, group * world_size), "the bucket bound, across ranks"
    if shard == 0:
        assert num_chunks == 0
        return
    assert chunk <= shard
    assert num_chunks == len(range(0, shard, chunk)) == -(-shard // chunk), "the chunks cover the shard"
    # No needless collectives: the chunk is as large as the bound allows.
    assert chunk == shard or (chunk + group) * world_size > bucket


def _wire(layout, rank: int, group: int, exact: int, bucket: int) -> Int8:
    return Int8([layout], param_dtype=torch.bfloat16, rank=rank, group=None, device=torch.device("cpu"),
                group_size=group, exact_numel=exact, bucket_numel=bucket)


@SLOWER
@given(numels=st.lists(st.one_of(st.integers(0, 150), st.integers(0, 3_000)), min_size=1, max_size=10),
       world_size=st.one_of(st.integers(1, 8), world_sizes), group=st.sampled_from([8, 64, 96]),
       exact=st.integers(0, 200), bucket=st.one_of(st.integers(1, 3_000), st.integers(1, 100_000)),
       data=st.data())
def test_int8_unit_plan_chunks_offsets_and_sides(numels, world_size, group, exact, bucket, data):
    layout = make_layout(numels, world_size, math.lcm(ALIGN, group))
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    wire = _wire(layout, rank, group, exact, bucket)
    plan = wire.plans[0]
    event(f"chunks: {len(plan.chunks) if len(plan.chunks) < 3 else 'more'}; side channel: {plan.side is not None}")
    event(f"last chunk partial: {layout.shard_numel % plan.chunks[0][1] != 0}")
    expected_chunk = plan_chunks(layout.shard_numel, world_size, bucket, group).chunk_numel
    start = 0
    for c, (chunk_start, n) in enumerate(plan.chunks):
        assert chunk_start == start and 0 < n <= expected_chunk and n % group == 0
        assert n * world_size <= max(bucket, group * world_size)
        assert plan.offsets[c + 1] - plan.offsets[c] == ops.packed_nbytes(n, group)
        start += n
    assert start == layout.shard_numel and plan.offsets[0] == 0, "chunks tile the shard exactly"
    side = side_positions(layout, exact, rank)
    got = [] if plan.side is None else plan.side.local.tolist()
    assert got == side
    for (chunk_start, n), inside in zip(plan.chunks, plan.chunk_sides):
        want = [p - chunk_start for p in side if chunk_start <= p < chunk_start + n]
        assert (inside.tolist() if inside is not None else []) == want
    # The side values travel at this rank's own count (no padding to the largest rank's).
    assert wire.payload_numel(0) == plan.offsets[-1] + len(side) * torch.bfloat16.itemsize
    if plan.side is not None:  # every side collective stays within the bucket bound
        assert all(sum(counts) <= max(bucket, world_size) for counts, _ in plan.side.rounds)


@FAST
@given(numels=st.lists(st.integers(0, 400), min_size=1, max_size=12), world_size=world_sizes,
       exact=st.integers(0, 300), data=st.data())
def test_side_positions_are_exactly_the_small_parameters_in_the_shard(numels, world_size, exact, data):
    layout = make_layout(numels, world_size)
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    lo, hi = layout.shard_range(rank)
    small = {x for slot in layout.slots if slot.numel <= exact for x in range(slot.offset, slot.offset + slot.numel)}
    positions = side_positions(layout, exact, rank)
    assert positions == sorted(set(positions)), "ascending, no repeats"
    assert {lo + p for p in positions} == {x for x in small if lo <= x < hi}


@SLOWER
@given(numels=st.lists(st.integers(0, 300), min_size=1, max_size=10), world_size=st.integers(1, 96),
       exact=st.integers(0, 300), bucket=st.one_of(st.integers(1, 64), st.integers(1, 5_000)), data=st.data())
def test_side_plan_restores_every_exact_value_where_it_came_from(numels, world_size, exact, bucket, data):
    layout = make_layout(numels, world_size)
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    plans = [_side_plan(layout, exact, r, bucket, torch.device("cpu")) for r in range(world_size)]
    if any(slot.numel <= exact and slot.numel > 0 for slot in layout.slots):
        assert all(p is not None for p in plans)
    else:
        assert all(p is None for p in plans)
        return
    me = plans[rank]
    for plan in plans:  # every rank plans the same collectives
        assert plan.per_round == me.per_round and len(plan.rounds) == len(me.rounds)
        assert all(c == mc and torch.equal(p, mp) for (c, p), (mc, mp) in zip(plan.rounds, me.rounds))
    event(f"side collectives: {len(me.rounds) if len(me.rounds) < 3 else 'more'}")
    values = torch.arange(1, layout.padded_numel + 1, dtype=torch.float64)  # nonzero, distinct
    sends = [values[layout.shard_span(r)][plan.local] for r, plan in enumerate(plans)]  # own count each
    working = torch.zeros_like(values)
    for k, (counts, positions) in enumerate(me.rounds):  # what all_gather_uneven hands every rank
        assert sum(counts) <= max(bucket, world_size), "each collective within the bucket bound"
        start = k * me.per_round
        working[positions] = torch.cat([send[start : start + counts[r]] for r, send in enumerate(sends)])
    small = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for slot in layout.slots:
        if slot.numel <= exact:
            small[slot.span] = True
    assert torch.equal(working[small], values[small]), "every exact value back in its place"
    assert not working[~small].any(), "nothing else written"


def _reference_working(master_full: torch.Tensor, layout, exact: int, group: int, dtype) -> torch.Tensor:
    """What every rank's working buffer must hold, from ``reference`` alone (whole shards at once)."""
    out = torch.empty(layout.padded_numel, dtype=dtype)
    for r in range(layout.world_size):
        piece = master_full[layout.shard_span(r)].clone()
        side = torch.tensor(side_positions(layout, exact, r), dtype=torch.int64)
        kept = piece[side].clone()
        piece[side] = 0.0
        decoded = reference.dequantize_int8(*reference.quantize_int8(piece, group), group, dtype)
        decoded[side] = kept.to(dtype)
        out[layout.shard_span(r)] = decoded
    return out


@SLOWER
@given(numels=st.lists(st.one_of(st.integers(0, 100), st.integers(0, 700)), min_size=1, max_size=8),
       world_size=st.one_of(st.integers(1, 4), st.integers(1, 24)), group=st.sampled_from([8, 64, 96]),
       exact=st.integers(0, 150), bucket=st.one_of(st.integers(1, 2_000), st.integers(1, 20_000)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_int8_wire_simulated_over_a_whole_world_matches_the_reference(numels, world_size, group, exact, bucket,
                                                                      dtype, data):
    # One process plays every rank: each encodes its payload, and a fake all_gather hands the
    # receiving rank the same byte range of every rank's payload, as the real collective does.
    layout = make_layout(numels, world_size, math.lcm(ALIGN, group))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    master_full = torch.randn(layout.padded_numel, generator=torch.Generator().manual_seed(seed)) * 3
    master_full[layout.numel :] = 0.0  # padding is zero
    wires = [_wire(layout, r, group, exact, bucket) for r in range(world_size)]
    for w in wires:
        w.param_dtype = dtype
    placement = SimpleNamespace(device_master=lambda unit: unit.master)
    payloads = []
    for r, w in enumerate(wires):
        unit = SimpleNamespace(index=0, layout=layout, master=master_full[layout.shard_span(r)].clone())
        payloads.append(w.encode(unit, placement))
    expected = _reference_working(master_full, layout, exact, group, dtype)
    rank = data.draw(st.integers(0, world_size - 1), label="receiving rank")
    mine = payloads[rank]
    plan = wires[rank].plans[0]
    event(f"chunks: {'several' if len(plan.chunks) > 1 else 'one'}; side channel: {plan.side is not None}")
    event(f"last chunk partial: {layout.shard_numel % plan.chunks[0][1] != 0}")

    def fake_all_gather(output, input, group=None):
        start = input.data_ptr() - mine.data_ptr()
        nbytes = input.numel() * input.element_size()
        assert 0 <= start and start + nbytes <= mine.numel(), "sends are slices of the payload"
        output.view(torch.uint8).copy_(torch.cat([p[start : start + nbytes] for p in payloads]))

    sides = [p[plan.offsets[-1] :].view(dtype) for p in payloads]  # each rank's own count of side values
    rounds = iter(range(len(plan.side.rounds) if plan.side is not None else 0))

    def fake_all_gather_uneven(output, input, counts, group=None):
        start = next(rounds) * plan.side.per_round
        assert input.numel() == counts[rank]
        output.copy_(torch.cat([side[start : start + counts[r]] for r, side in enumerate(sides)]))

    unit = SimpleNamespace(index=0, layout=layout, flat=torch.full((layout.padded_numel,), float("nan"), dtype=dtype))
    with mock.patch.object(comm, "all_gather", fake_all_gather), \
            mock.patch.object(comm, "all_gather_uneven", fake_all_gather_uneven):
        wires[rank].gather(unit, mine)
    assert next(rounds, None) is None, "every side collective ran"
    assert torch.equal(unit.flat, expected), (unit.flat.float() - expected.float()).abs().max()
    assert not unit.flat[layout.numel :].any(), "padding stays zero"
