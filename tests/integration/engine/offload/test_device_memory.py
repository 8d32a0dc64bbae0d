"""Host memory of the offload paths on CUDA: a large pinned buffer holds exactly its bytes (torch's
pinned allocator rounds each up to a power of two) and stays page-locked as long as any tensor over it
lives. One GPU."""

from __future__ import annotations

import gc

import pytest
import torch

import lightning_zeroq.swap.buffers as buffers

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda", torch.cuda.current_device())


def test_a_large_pinned_buffer_is_registered_exactly_and_unregistered_with_its_last_view(cuda, monkeypatch):
    released = []
    real = buffers._unregister
    monkeypatch.setattr(buffers, "_unregister", lambda pointer, mapping: (released.append(pointer),
                                                                          real(pointer, mapping)))
    n = (3 << 20) + 5  # bf16 elements: 6 MiB and 10 bytes, which torch's allocator would round to 8 MiB
    host = buffers.pinned_empty(n, torch.bfloat16)
    pointer = host.data_ptr()
    assert host.numel() == n and host.is_pinned() and pointer % buffers.PAGE == 0
    source = torch.randn(n, device=cuda).bfloat16()
    host.copy_(source, non_blocking=True)
    back = torch.empty_like(source).copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    view = host[10:20]
    del host
    gc.collect()
    assert released == [] and view.is_pinned(), "a view keeps the pages and their registration"
    del view
    gc.collect()
    assert released == [pointer]
    small = buffers.pinned_empty(100, torch.float32)
    assert small.is_pinned(), "a small buffer comes from torch's pinned allocator"
