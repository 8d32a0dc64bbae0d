"""``chunks.check_chunks``: the chunk metadata every reader checks when it opens a checkpoint. Any cut
of a tensor into ranks' flat ranges passes; chunks outside the shape, overlapping, leaving a gap,
without a stored item or with an item too short for them are each one line naming the tensor."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from lightning_zeroq.checkpoint.boxes import flat_range_boxes
from lightning_zeroq.checkpoint.chunks import check_chunks

ITEM_OVERHEAD = 1024  # what torch.save adds to a tensor's bytes, roughly


def _metadata(shape, chunks, lengths=None) -> Metadata:
    """One fp32 tensor ``"w"`` of ``shape`` stored as ``chunks`` ((offsets, sizes) pairs)."""
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    storage = {}
    for i, (offsets, sizes) in enumerate(chunks):
        length = lengths[i] if lengths is not None else 4 * math.prod(sizes) + ITEM_OVERHEAD
        storage[MetadataIndex("w", torch.Size(offsets), i)] = _StorageInfo("__0_0.distcp", 64 * (i + 1), length)
    return Metadata(state_dict_metadata={"w": md}, storage_data=storage)


@st.composite
def shape_and_cuts(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    total = math.prod(shape)
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=5)))
    return shape, [0, *cuts, total]


@settings(max_examples=200, deadline=None)
@given(shape_and_cuts())
def test_any_cut_into_flat_ranges_passes(case):
    shape, cuts = case
    chunks = [(b.offsets, b.sizes) for start, stop in zip(cuts, cuts[1:]) for b in flat_range_boxes(shape, start, stop)]
    assert check_chunks(_metadata(shape, chunks), "ckpt/.metadata") == []


@pytest.mark.parametrize("chunks, lengths, says", [
    ([((0, 0), (30, 4)), ((30, 0), (30, 4))], None, "hold 240 of its 256 elements"),
    ([((0, 0), (34, 4)), ((34, 0), (34, 4))], None, "at offsets (34, 0) with sizes (34, 4), outside the tensor"),
    ([((0, 0), (34, 4)), ((30, 0), (30, 4)), ((60, 0), (4, 4))], None, "two that overlap, at offsets (0, 0) and (30, 0)"),
    ([((0, 0), (34, 4)), ((34,), (30,))], None, "not of the tensor's 2 dimension(s)"),
    ([((0, 0), (34, 4)), ((34, 0), (30, 4))], [4 * 34 * 4 + ITEM_OVERHEAD, 100], "do not fit its stored item of 100"),
])
def test_inconsistent_chunks_are_one_line_naming_the_tensor(chunks, lengths, says):
    errors = check_chunks(_metadata((64, 4), chunks, lengths), "ckpt/.metadata")
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith("ckpt/.metadata: the chunks it lists for 'w' (shape (64, 4))") and says in errors[0], \
        errors


def test_a_chunk_without_a_stored_item_is_named():
    metadata = _metadata((64, 4), [((0, 0), (34, 4)), ((34, 0), (30, 4))])
    metadata.storage_data.pop(MetadataIndex("w", torch.Size((34, 0))))
    errors = check_chunks(metadata, "ckpt/.metadata")
    assert len(errors) == 1 and "at offsets (34, 0) with sizes (30, 4) that has no stored item" in errors[0], errors
