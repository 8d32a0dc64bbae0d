"""The 16-bit quantize kernels' branch-free quotient (``csrc/quant_int8.cu``, ``encode_remainder``) against the
reference's division, emulated on the CPU by ``tests/ops/quotient_exhaustive.py``: its self-test against exact
rationals, the scale of every absmax, and the pairs of a few groups at both ends of each format (the largest
scales, and for bfloat16 the smallest, which take the exact division). The script itself checks every pair."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")

from tests.ops import quotient_exhaustive as Q  # noqa: E402


def test_the_emulation_agrees_with_exact_rationals(capsys: pytest.CaptureFixture[str]) -> None:
    Q.self_test(seed=1, n=2000)
    assert "agree with exact rationals" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", sorted(Q.TOP))
def test_one_remainder_step_gives_every_scale(dtype: str) -> None:
    assert Q.check_scales(dtype) == 0


@pytest.mark.parametrize(("dtype", "absmax_bits"), [("bfloat16", (Q.TOP["bfloat16"] - 24, Q.TOP["bfloat16"] + 1)),
                                                    ("float16", (Q.TOP["float16"] - 24, Q.TOP["float16"] + 1)),
                                                    ("bfloat16", (1, 200)), ("float16", (0x3C00, 0x3C18))])
def test_every_pair_of_a_few_groups_encodes_as_the_reference(dtype: str, absmax_bits: tuple[int, int]) -> None:
    got = Q.check_block((dtype, *absmax_bits))
    assert got["pairs"] > 0 and got["code_mismatch"] == 0
    assert max(got["max_abs_qref_q_mismatch"], got["max_abs_q_q_mismatch"]) < 0.5  # a different quotient: code 0
