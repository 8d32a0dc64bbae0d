"""Layout arithmetic and the loss scaler, without processes."""

from __future__ import annotations

import pytest

from lightning_zeroq.zero.layout import ALIGN, make_layout, plan_units
from lightning_zeroq.zero.loss_scaler import DynamicLossScaler


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("numels", [[1], [5, 7, 100], [4096], [63, 64, 65, 1000, 3]])
def test_segments_partition_every_parameter_exactly(world_size, numels):
    layout = make_layout(numels, world_size)
    assert layout.padded_numel % (world_size * ALIGN) == 0
    assert layout.padded_numel >= sum(numels) and layout.shard_numel % ALIGN == 0
    covered = {i: [] for i in range(len(numels))}
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel
        for seg in layout.segments(rank):
            slot = layout.slots[seg.param]
            assert lo + seg.shard_start == slot.offset + seg.param_start  # same flat element
            assert 0 <= seg.shard_start and seg.shard_start + seg.numel <= layout.shard_numel
            covered[seg.param].append((seg.param_start, seg.param_start + seg.numel))
    for i, numel in enumerate(numels):
        pieces = sorted(covered[i])
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # contiguous, no overlap


def test_plan_units_respects_bound_and_keeps_big_params_whole():
    assert plan_units([10, 10, 10, 50, 5], bound=25) == [[0, 1], [2], [3], [4]]
    assert plan_units([10, 10], bound=100) == [[0, 1]]
    units = plan_units(list(range(1, 30)), bound=40)
    assert sum(len(u) for u in units) == 29
    assert all(sum(i + 1 for i in u) <= 40 for u in units)


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(scale=8.0, growth_interval=2, min_scale=2.0)
    s.update(found_inf=True)
    assert s.scale == 4.0 and s.skipped_steps == 1
    s.update(False), s.update(False)
    assert s.scale == 8.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0  # never below min_scale
    static = DynamicLossScaler(scale=128.0, dynamic=False)
    static.update(True), static.update(False)
    assert static.scale == 128.0 and static.skipped_steps == 1
