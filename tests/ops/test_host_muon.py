"""Muon's elementwise parts in the host kernel (csrc/host_adam.c: ``zq_muon_blends``, ``zq_muon_applies``)
against torch's ops, bitwise: the momentum blend (``lerp_``, Nesterov's ``lerp``, the cast to bf16 for the
device) and the apply (``mul_`` by the decay, ``add_`` with the adjusted learning rate, the bf16 copy), on
sizes with torch's scalar tails, both lerp weights, every dtype and thread count; on a GPU also against
torch's CUDA ops, which the device path of the optimizer runs."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_zeroq.ops import host_adam as H
from tests.host_kernel import require

SIZES = (1, 5, 16, 33, 4096 + 37, 300_007)


@pytest.fixture(scope="module")
def kernel() -> H.HostAdam:
    kernel = require()
    assert kernel.muon, "the host kernel's Muon parts do not match torch's ops here"
    return kernel


def _torch_blend(buf, grad, momentum, nesterov, gmul, dtype):
    g = grad.float().mul_(gmul)
    buf.lerp_(g, 1 - momentum)
    return (g.lerp(buf, momentum) if nesterov else buf).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    "momentum,nesterov,gmul", [(0.95, True, 1.0), (0.95, False, 0.25), (0.3, True, 3.0), (0.5, True, 1.0)]
)
@pytest.mark.parametrize("grad_dtype,out_dtype", list(itertools.product([torch.float32, torch.bfloat16], repeat=2)))
def test_blend_is_torchs_lerps(kernel, n, momentum, nesterov, gmul, grad_dtype, out_dtype) -> None:
    gen = torch.Generator().manual_seed(n)
    buf, grad = torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    ours, out = buf.clone(), torch.empty(n, dtype=out_dtype)
    kernel.run_muon([kernel.muon_blend(ours, grad, out, momentum=momentum, nesterov=nesterov, gmul=gmul)], threads=2)
    expected = _torch_blend(buf, grad, momentum, nesterov, gmul, out_dtype)
    assert torch.equal(ours, buf)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("working", [False, True])
def test_apply_is_torchs_mul_and_add(kernel, n, weight_decay, update_dtype, working) -> None:
    gen = torch.Generator().manual_seed(7 * n)
    param, update = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(update_dtype)
    lr, adjusted = 0.02, 0.02 * 1.4142135
    ours, copy = param.clone(), torch.empty(n, dtype=torch.bfloat16) if working else None
    job = kernel.muon_apply(ours, update, decay=1 - lr * weight_decay, lr=adjusted, working=copy)
    kernel.run_muon([job], threads=3)
    param.mul_(1 - lr * weight_decay).add_(update, alpha=-adjusted)
    assert torch.equal(ours, param)
    if copy is not None:
        assert torch.equal(copy, param.bfloat16())


def test_many_jobs_in_one_run_as_each_alone(kernel) -> None:
    gen = torch.Generator().manual_seed(3)
    sizes = [70_001, 3, 200_000, 17]
    bufs = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    together = [b.clone() for b in bufs]
    kernel.run_muon([kernel.muon_blend(b, g, o, momentum=0.9, nesterov=True) for b, g, o in zip(together, grads, outs)])
    for b, g, o, t in zip(bufs, grads, outs, together):
        alone = torch.empty_like(o)
        kernel.run_muon([kernel.muon_blend(b, g, alone, momentum=0.9, nesterov=True)], threads=1)
        assert torch.equal(t, b) and torch.equal(o, alone)


def test_bad_tensors_are_refused(kernel) -> None:
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match=r"muon_blend needs contiguous CPU tensors of one size \(8 elements\)"):
        kernel.muon_blend(buf, torch.zeros(9), torch.zeros(8), momentum=0.9, nesterov=False)
    with pytest.raises(ValueError, match="torch.float16"):
        kernel.muon_apply(buf, torch.zeros(8, dtype=torch.float16), decay=1.0, lr=0.1)
    with pytest.raises(ValueError, match="must not overlap"):
        kernel.muon_blend(buf, buf, torch.zeros(8), momentum=0.9, nesterov=False)
    with pytest.raises(ValueError, match="separate calls"):
        kernel.run_muon([kernel.muon_blend(buf, torch.zeros(8), torch.zeros(8), momentum=0.9, nesterov=False),
                         kernel.muon_apply(torch.zeros(8), torch.zeros(8), decay=1.0, lr=0.1)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_host_parts_are_the_device_paths_bits(kernel) -> None:
    """The device path steps with torch's CUDA ops: the host kernel gives their bits too."""
    gen = torch.Generator().manual_seed(11)
    n = 1_000_003
    buf, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    ours, out = buf.clone(), torch.empty(n, dtype=torch.bfloat16)
    kernel.run_muon([kernel.muon_blend(ours, grad, out, momentum=0.95, nesterov=True, gmul=0.5)])
    on_device = buf.cuda()
    expected = _torch_blend(on_device, grad.cuda(), 0.95, True, 0.5, torch.bfloat16)
    assert torch.equal(ours, on_device.cpu()) and torch.equal(out, expected.cpu())
    param = torch.randn(n, generator=gen)
    mine = param.clone()
    kernel.run_muon([kernel.muon_apply(mine, out, decay=1 - 0.02 * 0.1, lr=0.04)])
    assert torch.equal(mine, param.cuda().mul_(1 - 0.02 * 0.1).add_(out.cuda(), alpha=-0.04).cpu())
