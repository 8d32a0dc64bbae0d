"""Property tests of ``checkpoint.boxes``: a flat range of any tensor as rectangular boxes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_zeroq.checkpoint.boxes import flat_range_boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=5)))
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    return shape, start, stop


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_boxes_cover_exactly_the_range_in_flat_order(case):
    shape, start, stop = case
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    mark = torch.zeros(shape, dtype=torch.int64)
    index = torch.arange(math.prod(shape)).reshape(shape)
    flat = start
    for box in boxes:
        assert len(box.offsets) == len(box.sizes) == len(shape)
        assert box.numel > 0 and box.flat_start == flat
        region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        mark[region] += 1
        # contiguous in flat order: the box's elements are flat_start, flat_start + 1, ...
        assert index[region].reshape(-1).tolist() == list(range(box.flat_start, box.flat_start + box.numel))
        flat += box.numel
    assert flat == stop
    expected = torch.zeros(math.prod(shape), dtype=torch.int64)
    expected[start:stop] = 1
    assert torch.equal(mark.reshape(-1), expected)  # disjoint, and exactly the range


def test_worst_case_reaches_the_bound():
    assert len(flat_range_boxes((3, 3, 3), 1, 26)) == 5


@pytest.mark.parametrize("bad", [(-1, 2), (3, 2), (0, 7)])
def test_a_range_outside_the_tensor_is_refused(bad):
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_range_boxes((2, 3), *bad)
