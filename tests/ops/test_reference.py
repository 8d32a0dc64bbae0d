"""The INT8 group-quantization reference (the specification) and the zeroq:: ops on CPU.

On CPU the ops run the reference itself, so expected values come from hand-worked examples or from
the independent float64 model in ``tests/ops/quant_model.py``, never from the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import lightning_zeroq.ops as ops
from lightning_zeroq.ops import reference
from tests.ops import quant_model as model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BAD_GROUP_SIZES = [0, -8, 12]
# float32 rounding of x / scale and of code * scale adds at most 2 * 127 * 2**-24 ~ 1.5e-5 scales.
REL_SLACK = 1e-4


def _random(numel: int, dtype: torch.dtype, magnitude: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=gen) * magnitude).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


# ---- numerical behaviour ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("group_size", [8, 64, 192])
def test_round_trip_error_within_half_a_scale(dtype, magnitude, group_size):
    x = _random(group_size * 37, dtype, magnitude)
    codes, scales = reference.quantize_int8(x, group_size)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (x.numel() // group_size,)
    decoded = reference.dequantize_int8(codes, scales, group_size, torch.float32)
    error = (x.float() - decoded).abs().view(-1, group_size)
    assert (error <= scales[:, None] * 0.5 * (1 + REL_SLACK)).all()
    assert codes.min() >= -127 and codes.max() <= 127
    model.assert_quantizes_to(codes, scales, x, group_size)
    want_codes, want_scales = model.quantize(x, group_size)
    for out_dtype in DTYPES:
        decoded = reference.dequantize_int8(codes, scales, group_size, out_dtype)
        model.assert_decodes_to(decoded, want_codes, want_scales, group_size)


# Per dtype: random values over the whole exponent range, per group one magnitude (2^-150 .. 2^127
# for float32 and bfloat16, so some scales are subnormal), and raw bit patterns (all magnitudes in
# one group).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [8, 24, 64, 256])
def test_reference_agrees_with_the_independent_model(dtype, group_size):
    gen = torch.Generator().manual_seed(group_size)
    exponents = torch.randint(-150, 128, (400, 1), generator=gen).double()
    clustered = (torch.rand(400, group_size, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0**exponents
    width = 32 if dtype == torch.float32 else 16
    bits = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), (400 * group_size,), generator=gen)
    raw = bits.to(torch.int32 if width == 32 else torch.int16).view(dtype)
    x = torch.cat([clustered.flatten().to(dtype), raw])
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))  # inf and NaN have their own tests
    codes, scales = reference.quantize_int8(x, group_size)
    model.assert_quantizes_to(codes, scales, x, group_size)
    assert (scales[:400] > 0).any() and (scales[:400] < 2.0**-126).any()  # subnormal scales reached
    want_codes, want_scales = model.quantize(x, group_size)
    for out_dtype in DTYPES:
        decoded = reference.dequantize_int8(codes, scales, group_size, out_dtype)
        model.assert_decodes_to(decoded, want_codes, want_scales, group_size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_group_has_scale_zero_and_decodes_to_zeros(dtype):
    x = torch.cat([torch.zeros(64), -torch.zeros(64), _random(64, torch.float32)]).to(dtype)
    codes, scales = reference.quantize_int8(x, 64)
    assert scales[0] == 0 and scales[1] == 0 and not torch.signbit(scales[:2]).any()
    assert (codes[:128] == 0).all()
    decoded = reference.dequantize_int8(codes, scales, 64, dtype)
    assert not decoded.isnan().any()
    assert (decoded[:128] == 0).all()


def test_single_outlier_sets_the_scale():
    x = torch.full((64,), 1e-3)
    x[17] = -1000.0
    codes, scales = reference.quantize_int8(x, 64)
    assert scales[0] == torch.tensor(1000.0) / torch.tensor(127.0)
    assert codes[17] == -127
    assert (codes[torch.arange(64) != 17] == 0).all()  # 1e-3 / 7.87 rounds to 0
    decoded = reference.dequantize_int8(codes, scales, 64, torch.float32)
    assert (decoded - x).abs().max() <= scales[0] * 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_round_half_to_even(dtype):
    # absmax 127 gives scale 1 and absmax 63.5 gives scale 0.5, so these quotients are exact ties.
    ties = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 125.5, 126.5, -126.5])
    expected = torch.tensor([0, 2, 2, 4, 0, -2, -2, 126, 126, -126], dtype=torch.int8)
    group = torch.zeros(64)
    group[0] = 127.0
    group[1 : 1 + len(ties)] = ties
    half = torch.zeros(64)
    half[0] = 63.5
    half[1:5] = torch.tensor([0.25, 0.75, -0.25, -0.75])
    codes, scales = reference.quantize_int8(torch.cat([group, half]).to(dtype), 64)
    assert scales.tolist() == [1.0, 0.5]
    assert torch.equal(codes[1 : 1 + len(ties)], expected)
    assert codes[0] == 127 and codes[64] == 127
    assert codes[65:69].tolist() == [0, 2, 0, -2]


def test_clamp_and_underflow_with_subnormal_scales():
    tiny = 2.0**-149  # the smallest float32 subnormal
    # absmax 256 * tiny: scale = 256/127 * tiny rounds to 2 * tiny, so 256 * tiny / scale = 128
    # (and 255 * tiny gives the tie 127.5, which rounds to 128): both clamp to 127.
    clamped = torch.zeros(8)
    clamped[:4] = torch.tensor([256.0, -256.0, 255.0, 2.0]) * tiny
    # absmax 3 * tiny: 3/127 * tiny rounds to a scale of 0; codes and decode are 0, never NaN.
    underflow = torch.tensor([3.0, -1.0, 0, 0, 0, 0, 0, 0]) * tiny
    codes, scales = reference.quantize_int8(torch.cat([clamped, underflow]), 8)
    assert scales[0] == 2 * tiny and scales[1] == 0
    assert codes[:4].tolist() == [127, -127, 127, 1]
    assert (codes[8:] == 0).all()
    decoded = reference.dequantize_int8(codes, scales, 8, torch.float32)
    assert not decoded.isnan().any() and (decoded[8:] == 0).all()


def test_inputs_are_upcast_not_reinterpreted():
    x = torch.tensor([1.0, -2.0, 0.5, 4.0, 0, 0, 0, 0], dtype=torch.bfloat16)
    codes, scales = reference.quantize_int8(x, 8)
    assert scales.item() == pytest.approx(4.0 / 127)
    assert codes[:4].tolist() == [32, -64, 16, 127]


# ---- non-finite input ---------------------------------------------------------------------------

NAN_SCALE_BITS = 0x7FC00000  # the scale of a group holding NaN or +-inf (torch's float('nan'))
NON_FINITE = {"nan": float("nan"), "-nan": -float("nan"), "inf": float("inf"), "-inf": -float("inf")}


def _poisoned(dtype: torch.dtype, bad: float, position: int, group_size: int = 64) -> torch.Tensor:
    """Three groups [finite | finite with one ``bad`` element at ``position`` | finite]."""
    x = _random(3 * group_size, torch.float32, seed=position)
    x[group_size + position] = bad
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", list(NON_FINITE))
@pytest.mark.parametrize("position", [0, 37, 63])
def test_a_non_finite_element_makes_its_group_nan_and_only_it(dtype, bad, position):
    x = _poisoned(dtype, NON_FINITE[bad], position)
    codes, scales = reference.quantize_int8(x, 64)
    assert _bits(scales)[1].item() == NAN_SCALE_BITS
    assert (codes[64:128] == 0).all()
    # The neighbours are encoded as if the poisoned group were not there, bit for bit.
    for g in (0, 2):
        part = slice(g * 64, (g + 1) * 64)
        model.assert_quantizes_to(codes[part], scales[g : g + 1], x[part].contiguous(), 64)
    assert scales[[0, 2]].isfinite().all() and (scales[[0, 2]] > 0).all()
    # The packed op carries the same bytes, and every output dtype decodes the whole group, and
    # nothing else, to NaN.
    packed = ops.quantize_pack_int8(x)
    assert torch.equal(packed, torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)]))
    for out_dtype in DTYPES:
        out = ops.unpack_dequantize_int8(packed, dtype=out_dtype)
        assert out[64:128].isnan().all()
        assert not out[:64].isnan().any() and not out[128:].isnan().any()
        model.assert_decodes_to(out, *model.quantize(x, 64), 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_nan_and_mixed_non_finite_groups(dtype):
    nan, inf = float("nan"), float("inf")
    all_nan = torch.full((64,), nan)
    mixed = torch.zeros(64)
    mixed[[3, 9, 17, 60]] = torch.tensor([inf, -inf, nan, -nan])
    infs_only = torch.full((64,), -inf)
    finite = _random(64, torch.float32, seed=5)
    x = torch.cat([all_nan, mixed, infs_only, finite]).to(dtype)
    codes, scales = reference.quantize_int8(x, 64)
    assert _bits(scales)[:3].tolist() == [NAN_SCALE_BITS] * 3
    assert (codes[: 3 * 64] == 0).all()
    model.assert_quantizes_to(codes, scales, x, 64)
    packed = ops.quantize_pack_int8(x)
    for out_dtype in DTYPES:
        out = ops.unpack_dequantize_int8(packed, dtype=out_dtype)
        assert out[: 3 * 64].isnan().all() and not out[3 * 64 :].isnan().any()
        model.assert_decodes_to(out, *model.quantize(x, 64), 64)


def test_largest_finite_values_stay_finite():
    """Only inf and NaN poison a group: the largest finite inputs of each dtype do not."""
    for dtype in DTYPES:
        top = torch.finfo(dtype).max
        x = torch.zeros(64, dtype=dtype)
        x[0], x[1] = top, -top
        codes, scales = reference.quantize_int8(x, 64)
        assert scales.isfinite().all() and codes[:2].tolist() == [127, -127]


# ---- packed layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [8, 64, 1024])
def test_packed_nbytes(group_size):
    for num_groups in (0, 1, 3, 1000):
        n = num_groups * group_size
        assert ops.packed_nbytes(n, group_size) == n + 4 * n // group_size
        assert ops.numel_from_packed(ops.packed_nbytes(n, group_size), group_size) == n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_groups", [0, 1, 3, 50])
def test_pack_and_unpack_match_the_model(dtype, num_groups):
    x = _random(num_groups * 64, dtype, seed=num_groups)
    codes, scales = model.quantize(x, 64)
    packed = ops.quantize_pack_int8(x)
    assert packed.dtype == torch.uint8 and packed.numel() == ops.packed_nbytes(x.numel())
    assert (packed.numpy() == model.packed(codes, scales)).all()
    for out_dtype in DTYPES:
        out = torch.full((x.numel(),), float("nan"), dtype=out_dtype)
        assert ops.unpack_dequantize_int8(packed, out) is out
        model.assert_decodes_to(out, codes, scales, 64)


def test_gather_like_slices_at_unaligned_offsets():
    """Three ranks' packed buffers back to back, behind one odd byte: every slice decodes."""
    shards = [_random(64 * 3, torch.bfloat16, seed=r) for r in range(3)]
    nbytes = ops.packed_nbytes(shards[0].numel())
    gathered = torch.zeros(1 + 3 * nbytes, dtype=torch.uint8)
    for r, shard in enumerate(shards):
        ops.quantize_pack_int8(shard, gathered[1 + r * nbytes : 1 + (r + 1) * nbytes])
    full = torch.empty(3 * shards[0].numel(), dtype=torch.bfloat16)
    for r, (shard, part) in enumerate(zip(shards, full.chunk(3))):
        ops.unpack_dequantize_int8(gathered[1 + r * nbytes : 1 + (r + 1) * nbytes], part)
        model.assert_decodes_to(part, *model.quantize(shard, 64), 64)


def test_unpack_allocates_when_out_is_omitted():
    x = _random(128, torch.float16)
    packed = ops.quantize_pack_int8(x)
    assert ops.unpack_dequantize_int8(packed).dtype == torch.float32
    y = ops.unpack_dequantize_int8(packed, dtype=torch.float16)
    assert y.dtype == torch.float16 and y.shape == x.shape


# ---- argument errors --------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", BAD_GROUP_SIZES)
def test_bad_group_sizes_raise(group_size):
    x = torch.zeros(96)
    calls = [
        lambda: ops.packed_nbytes(96, group_size),
        lambda: ops.quantize_pack_int8(x, torch.empty(102, dtype=torch.uint8), group_size),
        lambda: ops.unpack_dequantize_int8(torch.zeros(102, dtype=torch.uint8), group_size=group_size),
        lambda: torch.ops.zeroq.quantize_pack_int8(x, group_size, torch.empty(102, dtype=torch.uint8)),
        lambda: torch.ops.zeroq.unpack_dequantize_int8(torch.zeros(102, dtype=torch.uint8), group_size, x),
        lambda: reference.quantize_int8(x, group_size),
        lambda: reference.dequantize_int8(torch.zeros(96, dtype=torch.int8), torch.zeros(8), group_size, torch.float32),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=rf"positive multiple of 8, got {group_size}\b"):
            call()


def test_length_not_a_multiple_of_the_group_raises():
    with pytest.raises(ValueError, match="100 elements, not a multiple of group_size 64"):
        ops.quantize_pack_int8(torch.zeros(100))
    with pytest.raises(ValueError, match="100 elements, not a multiple of group_size 64"):
        torch.ops.zeroq.quantize_pack_int8(torch.zeros(100), 64, torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="100 elements"):
        ops.packed_nbytes(100)
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        reference.dequantize_int8(torch.zeros(100, dtype=torch.int8), torch.zeros(1), 64, torch.float32)


def test_wrong_sizes_raise():
    x = torch.zeros(128)
    with pytest.raises(ValueError, match="exactly 136 bytes .* got 135"):
        ops.quantize_pack_int8(x, torch.empty(135, dtype=torch.uint8))
    with pytest.raises(ValueError, match="exactly 136 bytes .* got 137"):
        torch.ops.zeroq.quantize_pack_int8(x, 64, torch.empty(137, dtype=torch.uint8))
    with pytest.raises(ValueError, match="135 bytes is not a whole number of groups"):
        ops.unpack_dequantize_int8(torch.empty(135, dtype=torch.uint8), torch.empty(128))
    with pytest.raises(ValueError, match="decodes to 128 elements, but out has 64"):
        ops.unpack_dequantize_int8(torch.empty(136, dtype=torch.uint8), torch.empty(64))
    with pytest.raises(ValueError, match="expected 2 scales for 128 codes"):
        reference.dequantize_int8(torch.zeros(128, dtype=torch.int8), torch.zeros(3), 64, torch.float32)


def test_wrong_dtypes_and_shapes_raise():
    with pytest.raises(ValueError, match="x must be float32, bfloat16, float16, got torch.int32"):
        ops.quantize_pack_int8(torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be 1-D"):
        ops.quantize_pack_int8(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.quantize_pack_int8(torch.zeros(128)[::2])
    with pytest.raises(ValueError, match="out must be uint8"):
        ops.quantize_pack_int8(torch.zeros(64), torch.empty(68, dtype=torch.int8))
    with pytest.raises(ValueError, match="codes must be int8"):
        reference.dequantize_int8(torch.zeros(64, dtype=torch.uint8), torch.zeros(1), 64, torch.float32)
    with pytest.raises(ValueError, match="scales must be float32"):
        reference.dequantize_int8(torch.zeros(64, dtype=torch.int8), torch.zeros(1, dtype=torch.float16), 64, torch.float32)
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got torch.float64"):
        ops.unpack_dequantize_int8(torch.empty(68, dtype=torch.uint8), dtype=torch.float64)
    with pytest.raises(ValueError, match="out must be float32, bfloat16, float16"):
        ops.unpack_dequantize_int8(torch.empty(68, dtype=torch.uint8), torch.empty(64, dtype=torch.float64))
    with pytest.raises(ValueError, match="disagrees with out.dtype"):
        ops.unpack_dequantize_int8(torch.empty(68, dtype=torch.uint8), torch.empty(64), dtype=torch.float16)


# ---- the custom ops ---------------------------------------------------------------------------


def test_ops_are_registered_and_run_on_cpu():
    from lightning_zeroq.ops import _library

    assert _library.OP_NAMES == ("quantize_pack_int8", "unpack_dequantize_int8", "widen_checked")
    for name in _library.OP_NAMES:
        assert hasattr(torch.ops.zeroq, name)
    x = _random(192, torch.bfloat16)
    codes, scales = model.quantize(x, 64)
    packed = torch.empty(ops.packed_nbytes(192), dtype=torch.uint8)
    assert torch.ops.zeroq.quantize_pack_int8(x, 64, packed) is None
    assert (packed.numpy() == model.packed(codes, scales)).all()
    out = torch.empty(192, dtype=torch.float16)
    assert torch.ops.zeroq.unpack_dequantize_int8(packed, 64, out) is None
    model.assert_decodes_to(out, codes, scales, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_groups", [0, 3])
def test_opcheck_on_cpu(dtype, num_groups):
    x = _random(num_groups * 64, dtype)
    packed = ops.quantize_pack_int8(x)
    cases = [
        (torch.ops.zeroq.quantize_pack_int8.default, (x, 64, torch.empty_like(packed))),
        (torch.ops.zeroq.unpack_dequantize_int8.default, (packed, 64, torch.empty(x.numel(), dtype=dtype))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_fake_tensors_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(640, dtype=torch.bfloat16)
        packed = torch.empty(ops.packed_nbytes(640), dtype=torch.uint8)
        torch.ops.zeroq.quantize_pack_int8(x, 64, packed)
        out = torch.empty(640, dtype=torch.float16)
        torch.ops.zeroq.unpack_dequantize_int8(packed, 64, out)
        with pytest.raises(ValueError, match="got 12"):
            torch.ops.zeroq.quantize_pack_int8(x, 12, packed)
        with pytest.raises(ValueError, match="exactly 680 bytes"):
            torch.ops.zeroq.quantize_pack_int8(x, 64, packed[1:])
        with pytest.raises(ValueError, match="decodes to 640 elements, but out has 639"):
            torch.ops.zeroq.unpack_dequantize_int8(packed, 64, out[1:])


# ---- import and loading -----------------------------------------------------------------------


def _run_python(code: str, **env: str) -> dict:
    """Runs ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    import os

    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "stderr": result.stderr}


def test_ops_import_and_cpu_use_touch_no_cuda_and_fallback_warns_once(tmp_path):
    """Import and CPU use touch no CUDA; without CUDA, loading falls back with one warning."""
    report = _run_python(
        """
        import json, torch, torch.utils.cpp_extension as cpp_extension

        def refuse(*args, **kwargs):
            raise AssertionError("compiled a library")

        loaded = []  # other packages (torchvision, imported by lightning) may load their own
        load_library = torch.ops.load_library
        torch.ops.load_library = lambda path: (loaded.append(str(path)), load_library(path))
        saved_load = cpp_extension.load
        cpp_extension.load = cpp_extension.load_inline = refuse
        import lightning_zeroq.ops as ops
        from lightning_zeroq.ops import _library

        ops.unpack_dequantize_int8(ops.quantize_pack_int8(torch.randn(128)))  # CPU use resolves nothing
        report = {
            "cuda_initialized": torch.cuda.is_initialized(),
            "backend": ops.active_backend().value,
            "cuda_kernels": _library.cuda_key_has_kernels(),
            "zeroq_libraries": [p for p in loaded if "zeroq" in p],
        }
        if not torch.cuda.is_available():  # on a CUDA machine this would build the kernels
            cpp_extension.load = saved_load
            report["backends"] = [ops.load_cuda_backend().value, ops.load_cuda_backend().value]
        print(json.dumps(report))
        """,
        ZEROQ_EXT_CACHE=str(tmp_path),
    )
    assert report["cuda_initialized"] is False and report["backend"] == "unresolved"
    assert report["cuda_kernels"] is False and report["zeroq_libraries"] == []
    if not torch.cuda.is_available():
        assert report["backends"] == ["reference", "reference"]
        assert report["stderr"].count("compiled CUDA kernels unavailable") == 1
        assert "compiling" not in report["stderr"]
        assert list(tmp_path.iterdir()) == []


def test_disable_ext_registers_the_reference_for_cuda():
    report = _run_python(
        """
        import json, logging, torch
        logging.basicConfig(level=logging.INFO)
        import lightning_zeroq.ops as ops
        from lightning_zeroq.ops import _library

        before = _library.cuda_key_has_kernels()
        backend = ops.load_cuda_backend()
        print(json.dumps({
            "before": before,
            "backend": backend.value,
            "after": _library.cuda_key_has_kernels(),
            "has_cuda_kernel": ops.has_cuda_kernel(),
        }))
        """,
        ZEROQ_DISABLE_EXT="1",
    )
    assert report["before"] is False and report["after"] is True
    assert report["backend"] == "reference" and report["has_cuda_kernel"] is False
    assert "disabled by ZEROQ_DISABLE_EXT=1" in report["stderr"]
    assert "WARNING" not in report["stderr"]


def test_cache_dir(monkeypatch, tmp_path):
    from lightning_zeroq.ops import _load

    monkeypatch.setenv("ZEROQ_EXT_CACHE", str(tmp_path / "ext"))
    assert _load.cache_dir() == tmp_path / "ext"
    monkeypatch.delenv("ZEROQ_EXT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _load.cache_dir() == tmp_path / "lightning_zeroq" / f"{torch.__version__}-cuda{torch.version.cuda}"
