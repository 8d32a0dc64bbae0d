"""The gradient's checked widening (``ops.widen_checked``): the values ``torch.add(x, 0.0)`` makes, bit for
bit, and the flag set exactly where a value is NaN or infinite; on the CPU (the reference) and, marked
``gpu``, the CUDA kernel against it."""

from __future__ import annotations

import os

import pytest
import torch

import lightning_zeroq.ops as ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPECIALS = [0.0, -0.0, 1.0, -2.5, 1e-40, -1e-42, 3e38, -3e38, 6e-8, float("inf"), -float("inf"), float("nan")]


def _values(n: int, dtype: torch.dtype, seed: int, specials: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-8, 8, (n,), generator=g).float()).to(dtype)
    if specials and n:
        s = torch.tensor([v for v in SPECIALS if v == v and abs(v) != float("inf")], dtype=torch.float32).to(dtype)
        idx = torch.randint(0, n, (s.numel(),), generator=g)
        x[idx] = s
    return x


def _expected(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    out = torch.add(x.cpu().float(), 0.0)  # widening is exact; + 0 turns -0 into +0
    return out, float(not bool(torch.isfinite(out).all()))


def _check(x: torch.Tensor, device: str) -> None:
    expected, bad = _expected(x)
    out = torch.full((x.numel(),), 7.0, device=device)
    flag = torch.zeros(1, device=device)
    ops.widen_checked(x.to(device), out, flag)
    nan = torch.isnan(expected)  # a NaN's payload is not specified; every other value is compared bitwise
    assert torch.equal(torch.isnan(out.cpu()), nan)
    assert torch.equal(out.cpu()[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    assert flag.item() == bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_the_reference_is_add_zero_and_isfinite(dtype, n):
    x = _values(n, dtype, 1, specials=True)
    _check(x, "cpu")
    assert not torch.signbit(torch.add(torch.tensor([-0.0], dtype=dtype), 0.0)).any()  # -0 + 0 is +0


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_a_single_non_finite_value_sets_the_flag_and_a_set_flag_stays(special):
    x = torch.ones(64, dtype=torch.bfloat16)
    x[37] = special
    out, flag = torch.empty(64), torch.zeros(1)
    ops.widen_checked(x, out, flag)
    assert flag.item() == 1.0
    ops.widen_checked(torch.ones(64, dtype=torch.bfloat16), out, flag)
    assert flag.item() == 1.0 and torch.equal(out, torch.ones(64))


def test_bad_arguments_name_the_value():
    x = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out has 7 elements, x has 8"):
        ops.widen_checked(x, torch.empty(7), torch.zeros(1))
    with pytest.raises(ValueError, match="out must be float32, got torch.bfloat16"):
        ops.widen_checked(x, torch.empty(8, dtype=torch.bfloat16), torch.zeros(1))
    with pytest.raises(ValueError, match="flag must hold one element, got 2"):
        ops.widen_checked(x, torch.empty(8), torch.zeros(2))
    with pytest.raises(ValueError, match="x must be 1-D"):
        ops.widen_checked(x.view(2, 4), torch.empty(8), torch.zeros(1))


def test_opcheck_on_cpu():
    x = _values(100, torch.bfloat16, 2, specials=True)
    torch.library.opcheck(torch.ops.zeroq.widen_checked.default, (x, torch.empty(100), torch.zeros(1)))


# ---- the CUDA kernel -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if os.environ.get("ZEROQ_DISABLE_EXT") == "1":
        pytest.skip("ZEROQ_DISABLE_EXT=1: the compiled kernels are disabled")
    ops.load_cuda_backend()
    if not ops.has_cuda_kernel():
        pytest.fail("the CUDA kernels did not load; see the log warning")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 4, 7, 1024, 1_000_003])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])  # where the output starts: the vector body and the scalar path
def test_the_cuda_kernel_is_the_reference_bitwise(cuda_kernels, dtype, n, offset):
    x = _values(n, dtype, n + offset, specials=True).cuda()
    out = torch.full((n + offset,), 7.0, device="cuda")
    flag = torch.zeros(1, device="cuda")
    ops.widen_checked(x, out[offset:], flag)
    expected, bad = _expected(x)
    assert torch.equal(out[offset:].cpu().view(torch.int32), expected.view(torch.int32))
    assert flag.item() == bad  # float16 makes 3e38 an inf
    assert torch.equal(out[:offset].cpu(), torch.full((offset,), 7.0))  # nothing written before it


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 4097, 999_999])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_the_cuda_kernel_flags_one_non_finite_value_anywhere(cuda_kernels, dtype, where, special):
    x = _values(1_000_000, dtype, 3, specials=True)
    x[where] = special
    _check(x, "cuda")
