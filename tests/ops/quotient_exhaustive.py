"""Exhaustive CPU check of the branch-free quotient of the 16-bit quantize kernels.

The kernels (``csrc/quant_int8.cu``, ``encode_remainder``) compute, per element x of a group with
divisor d (the group's scale, 1 for an all-zero group) and r = RN(1/d) (``__frcp_rn``), in float32
with one rounding per operation:

    q0   = RN(x * r)                 __fmul_rn
    rem  = RN(x - q0 * d)            __fmaf_rn(-q0, d, x)
    q    = RN(q0 + rem * r)          __fmaf_rn(rem, r, q0)      (Markstein's correction step)
    code = low byte of the bits of RN(q + 1.5 * 2^23)           (round half to even, no clamp)

for 16-bit input, with no test per element, and the exact division (the reference's ``x / d``) for
a whole group only where ``!(d >= 2^-100)``: the NaN scale of a non-finite group, and scales below
2^-100 (absmax < 127 * 2^-100, about 1e-28: only bfloat16 gets there), where the remainder can
underflow and lose bits.

Markstein's theorem (q' = RN(q + r * y) is RN(a / b) if y approximates 1/b with relative error
< 2^-24, q is a faithful quotient, i.e. RD or RU of a / b, and nothing underflows) does NOT cover
this by itself: q0 = RN(x * RN(1/d)) is off by one ulp on the far side of x / d (not faithful) for
about 1% of the pairs, and then rem is sometimes rounded. So the claim rests on exhaustion: for
EVERY pair a 16-bit group can hold,

    bfloat16: every finite absmax A > 0 (32639 bit patterns) and every x with 0 <= x <= A
              (5.3e8 pairs);
    float16:  the same (31743 values of A, 5.0e8 pairs);

with d = RN(A / 127) (only the group's absmax A matters, not its other elements), this script
checks that where d >= 2^-100 the kernel's code equals the reference's ``clamp(rint(RN(x / d)),
-127, 127)``, and that q == RN(x / d) bit for bit except where both are below 2^-10 (bfloat16 only:
x so small against d that q0 * d underflows; both codes are 0 there). Negative x mirror: every step
above is an odd function of x under round-to-nearest-even (a zero remainder's sign does not reach
q), and so is the reference. It also counts where Markstein's hypotheses fail, where the plain
product x * r would give another code (where a kernel without the remainder step needs a branch), and
what the branch-free form would give below the threshold (not used there). Also checked: the kernels'
scale, RN(A * RN(1/127)) corrected by one remainder step, equals RN(A / 127) for every finite A of
both formats.

Arithmetic. float32 operations are numpy's float32 operations (IEEE, round to nearest even,
subnormals kept), the same as the GPU's __fmul_rn, __fadd_rn and __frcp_rn. An fma is done
exactly: the product of two float32 is exact in float64, the sum with the third operand is float64
``s`` plus its exact error ``e`` (Knuth's TwoSum), and ``s + e`` is rounded to float32 once:
``float32(s)`` is that rounding unless ``s`` is exactly halfway between two float32 and ``e != 0``
(then the sign of ``e`` decides), which is handled. The reference quotient is float64 ``x / d``
rounded to float32: one correct rounding (53 >= 2 * 24 + 2 bits). The emulation is checked against
exact rational arithmetic (``fractions``) on random and edge operands first, and on pairs whose
remainder rounds (8 per block) during the run. tests/ops/test_kernels_gpu.py::
test_every_16bit_pair_matches_reference runs the same pairs (both signs) through the compiled
kernels on a GPU.

    python tests/ops/quotient_exhaustive.py            # both dtypes, ~5 min on 2 cores
    python tests/ops/quotient_exhaustive.py --dtype bfloat16 --workers 2

A proof, not a benchmark: it times nothing. ``tests/ops/test_quotient.py`` runs its self-test, the scales of
every absmax and a few blocks of pairs in the fast tier; this script runs every pair (minutes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from fractions import Fraction

import numpy as np

F32, F64 = np.float32, np.float64
C = F32(12582912.0)  # 1.5 * 2^23
# The kernel takes the branch-free form where the divisor d >= THRESHOLD (one compare per group,
# false for NaN); below it (absmax < 127 * 2^-100, about 1e-28: bfloat16 only, float16 never gets
# there) the remainder rem can underflow and lose bits, so the exact division decides.
THRESHOLD = F32(2.0**-100)
# Largest positive finite bit pattern of each 16-bit format.
TOP = {"bfloat16": 0x7F7F, "float16": 0x7BFF}


def to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of 16-bit patterns (exact)."""
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(F32)
    return bits.astype(np.uint16).view(np.float16).astype(F32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN_float32(a * b + c) with one rounding, for float32 arrays (finite, no overflow)."""
    p = a.astype(F64) * b.astype(F64)  # exact: 24 + 24 bits
    c64 = c.astype(F64)
    s = p + c64
    bp = s - p
    e = (p - (s - bp)) + (c64 - bp)  # TwoSum: s + e == p + c exactly
    f = s.astype(F32)
    f64 = f.astype(F64)
    toward = np.where(s > f64, F32(np.inf), F32(-np.inf))
    g = np.nextafter(f, toward)  # the other float32 neighbour of s (when s is not a float32)
    midpoint = (f64 != s) & ((f64 + g.astype(F64)) * 0.5 == s)
    fix = midpoint & (e != 0)
    if fix.any():
        hi, lo = np.maximum(f, g), np.minimum(f, g)
        f = np.where(fix, np.where(e > 0, hi, lo), f)
    return f


def fma_is_exact(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Whether a * b + c (exact) is a float32: then float64 holds it too (TwoSum error 0)."""
    p = a.astype(F64) * b.astype(F64)
    c64 = c.astype(F64)
    s = p + c64
    bp = s - p
    e = (p - (s - bp)) + (c64 - bp)
    return (e == 0) & (s.astype(F32).astype(F64) == s)


def exact_sign_of_residual(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """sign(x - q * d) exactly (q * d exact in float64; TwoSum keeps the sign of the exact sum)."""
    p = q.astype(F64) * d.astype(F64)
    x64 = x.astype(F64)
    s = x64 - p
    bp = s - x64
    e = (x64 - (s - bp)) + (-p - bp)
    return np.where(s != 0, np.sign(s), np.sign(e))


def reference_quotient(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    return (x.astype(F64) / d.astype(F64)).astype(F32)


def kernel_quotient(x: np.ndarray, d: np.ndarray, r: np.ndarray):
    q0 = x * r
    rem = fma32(-q0, d, x)
    q = fma32(rem, r, q0)
    return q0, rem, q


def codes_from(q: np.ndarray) -> np.ndarray:
    """Low byte of RN(q + 1.5 * 2^23) as int8 (the kernel's encoding, no clamp)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return ((q + C).view(np.uint32) & np.uint32(0xFF)).astype(np.uint8).view(np.int8)


def reference_codes(q: np.ndarray) -> np.ndarray:
    q = np.where(np.isnan(q), F32(0), q)
    return np.clip(np.rint(q), -127, 127).astype(np.int8)


def rn32(fr: Fraction) -> np.float32:
    # correct rounding of a rational to float32 (RNE), via candidates around float64 guesses
    with np.errstate(over="ignore"):
        guess = F32(float(fr))
    cands = [guess, np.nextafter(guess, F32(np.inf)), np.nextafter(guess, F32(-np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - fr), int(np.array(c).view(np.uint32)) & 1))
    return F32(best)


def self_test(seed: int = 0, n: int = 20000) -> None:
    """fma32 and the reference quotient against exact rationals, on random and edge operands."""
    rng = np.random.default_rng(seed)

    def rnd_f32(k):
        bits = rng.integers(0, 0x7F800000, size=k, dtype=np.uint32)
        v = bits.view(F32)
        return np.where(rng.random(k) < 0.5, -v, v).astype(F32)

    # operands near each other (cancellation, as rem) and far apart (as the final fma)
    a = rnd_f32(n) * F32(1e-20)
    b = rnd_f32(n) * F32(1e-20)
    c = rnd_f32(n) * F32(1e-30)
    x = rng.standard_normal(n).astype(F32)
    d = np.abs(rng.standard_normal(n)).astype(F32) / F32(127) + F32(1e-30)
    r = (F32(1) / d).astype(F32)
    q0 = x * r
    tests = [(a, b, c), (-q0, d, x), (rng.standard_normal(n).astype(F32) * F32(1e-7), r, q0)]
    # halfway cases for the double-rounding fix: c + tiny where c + half ulp is a float64 midpoint
    base = rng.standard_normal(n).astype(F32)
    half_ulp = (np.nextafter(base, F32(np.inf)).astype(F64) - base.astype(F64)) / 2
    tests.append((np.full(n, F32(1)), (half_ulp).astype(F32), base))  # exact midpoints: ties to even
    tiny = F32(2.0**-60)
    tests.append((np.full(n, tiny), np.full(n, tiny), ((base.astype(F64) + half_ulp).astype(F32))))
    checked = 0
    for aa, bb, cc in tests:
        got = fma32(aa, bb, cc)
        for i in range(0, n, 7):
            want = rn32(Fraction(float(aa[i])) * Fraction(float(bb[i])) + Fraction(float(cc[i])))
            assert got[i].view(np.uint32) == want.view(np.uint32) or (got[i] == 0 and want == 0), (
                aa[i], bb[i], cc[i], got[i], want)
            checked += 1
    xs, ds = rnd_f32(n), np.abs(rnd_f32(n))
    ds = np.where(ds == 0, F32(1), ds)
    with np.errstate(over="ignore", under="ignore"):
        got = reference_quotient(xs, ds)
        npdiv = xs / ds
    for i in range(0, n, 7):
        if not np.isfinite(got[i]):  # overflow: not a case of the kernels
            continue
        want = rn32(Fraction(float(xs[i])) / Fraction(float(ds[i])))
        if True:
            assert got[i].view(np.uint32) == want.view(np.uint32), (xs[i], ds[i], got[i], want)
            checked += 1
    assert np.array_equal(got.view(np.uint32), npdiv.view(np.uint32))
    print(f"self-test: fma32 and the reference quotient agree with exact rationals on {checked} operands")


def check_block(args):
    dtype, a_lo, a_hi = args
    a_bits = np.arange(a_lo, a_hi, dtype=np.int64)
    lengths = a_bits + 1  # x bits 0..A (all x with 0 <= x <= A: the bit order is the value order)
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    x_bits = np.arange(total, dtype=np.int64) - starts
    A = to_f32(np.repeat(a_bits, lengths), dtype)
    x = to_f32(x_bits, dtype)
    with np.errstate(under="ignore"):
        d = (A / F32(127)).astype(F32)  # the scale, RN(A / 127); never 0 here (A >= 2^-133)
        fast = d >= THRESHOLD  # the kernel's test: the branch-free form only there
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            r = (F32(1) / d).astype(F32)
            q0, rem, q = kernel_quotient(x, d, r)
        qref = reference_quotient(x, d)
    out = {"pairs": total, "fast_pairs": int(fast.sum())}
    same_q = q.view(np.uint32) == qref.view(np.uint32)
    same_code = codes_from(q) == reference_codes(qref)
    n = fast
    out["q_mismatch"] = int((n & ~same_q).sum())
    out["code_mismatch"] = int((n & ~same_code).sum())
    # Markstein's hypotheses on the fast pairs whose code can be nonzero (|x / d| >= 1/2)
    n = fast & (np.abs(qref) >= 0.5)
    out["fast_pairs_q_ge_half"] = int(n.sum())
    xn, q0n, dn, qrefn = x[n], q0[n], d[n], qref[n]
    sign = exact_sign_of_residual(xn, qrefn, dn)  # sign(x/d - RN(x/d))
    other = np.nextafter(qrefn, np.where(sign > 0, F32(np.inf), F32(-np.inf)))
    faithful = (q0n == qrefn) | ((sign != 0) & (q0n == other))
    out["q0_not_faithful"] = int((~faithful).sum())
    out["rem_not_exact"] = int((~fma_is_exact(-q0n, dn, xn)).sum())
    out["q0_is_final"] = int((q0n.view(np.uint32) == qrefn.view(np.uint32)).sum())
    # the plain product's code against the reference (what the old kernel must branch for)
    out["product_code_mismatch"] = int((codes_from(q0n) != reference_codes(qrefn)).sum())
    # Spot check of the emulation where it matters most: pairs whose remainder is not exact (the
    # fma rounds), recomputed in exact rational arithmetic.
    inexact = np.flatnonzero(~fma_is_exact(-q0n, dn, xn))[:8]
    r_n = r[n]
    for i in inexact:
        rem_exact = Fraction(float(xn[i])) - Fraction(float(q0n[i])) * Fraction(float(dn[i]))
        rem_i = rn32(rem_exact)
        assert rem_i.view(np.uint32) == fma32(-q0n[i:i + 1], dn[i:i + 1], xn[i:i + 1])[0].view(np.uint32)
        q_i = rn32(Fraction(float(rem_i)) * Fraction(float(r_n[i])) + Fraction(float(q0n[i])))
        assert q_i.view(np.uint32) == qrefn[i].view(np.uint32) == rn32(Fraction(float(xn[i])) / Fraction(float(dn[i]))).view(np.uint32)
    out["spot_checked_inexact"] = len(inexact)
    # below the threshold: what the branch-free form would give there (the kernel divides)
    s = ~fast
    out["slow_pairs"] = int(s.sum())
    out["slow_q_mismatch"] = int((s & ~same_q).sum())
    out["slow_code_mismatch"] = int((s & ~same_code).sum())
    out["max_d_q_mismatch"] = float(d[~same_q].max(initial=0))
    out["max_d_code_mismatch"] = float(d[~same_code].max(initial=0))
    out["max_abs_q"] = float(np.abs(qref[n]).max(initial=0))
    # where the quotient differs on the fast path: how large it is (tiny quotients: code 0 anyway)
    differ = fast & ~same_q
    out["max_abs_qref_q_mismatch"] = float(np.abs(qref[differ]).max(initial=0))
    out["max_abs_q_q_mismatch"] = float(np.abs(q[differ]).max(initial=0))
    big = np.abs(qref) >= 2.0**-10
    out["max_d_q_mismatch_qref_ge_2^-10"] = float(d[~same_q & big].max(initial=0))
    return out


def blocks(dtype: str, target: int = 1 << 22):
    a = 1
    top = TOP[dtype]
    while a <= top:
        hi = a
        size = 0
        while hi <= top and size + hi + 1 <= max(target, a + 1):
            size += hi + 1
            hi += 1
        hi = max(hi, a + 1)
        yield dtype, a, hi
        a = hi


def check_scales(dtype: str) -> int:
    """Mismatches of the kernels' scale (one remainder step) against RN(A / 127), over every finite A > 0."""
    A = to_f32(np.arange(1, TOP[dtype] + 1), dtype)
    c = F32(1) / F32(127)
    q0 = A * c
    rem = fma32(-q0, np.full_like(A, F32(127)), A)
    scale = fma32(rem, np.full_like(A, c), q0)
    ref = (A.astype(F64) / 127).astype(F32)
    return int((scale.view(np.uint32) != ref.view(np.uint32)).sum())


def run(dtype: str, workers: int) -> dict:
    t0 = time.time()
    totals: dict = {}
    with mp.Pool(workers) as pool:
        for out in pool.imap_unordered(check_block, list(blocks(dtype)), chunksize=1):
            for k, v in out.items():
                totals[k] = max(totals.get(k, 0), v) if k.startswith("max") else totals.get(k, 0) + v
    totals["seconds"] = round(time.time() - t0, 1)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=list(TOP))
    parser.add_argument("--workers", type=int, default=mp.cpu_count())
    parser.add_argument("--threshold-log2", type=int, default=-100, help="the kernel's divisor threshold")
    args = parser.parse_args()
    global THRESHOLD
    THRESHOLD = F32(2.0**args.threshold_log2)
    self_test()
    ok = True
    for dtype in args.dtype:
        scale_mismatches = check_scales(dtype)
        print(f"{dtype}: scale by one remainder step: {scale_mismatches} of {TOP[dtype]} absmax values differ from RN(A / 127)")
        ok &= scale_mismatches == 0
        t = run(dtype, args.workers)
        print(f"{dtype}: {t}")
        ok &= t["code_mismatch"] == 0 and max(t["max_abs_qref_q_mismatch"], t["max_abs_q_q_mismatch"]) < 0.5
        print(
            f"{dtype}: {t['fast_pairs']} pairs (0 <= x <= absmax) with divisor >= 2^{np.log2(THRESHOLD):.0f}: "
            f"codes {'all equal' if t['code_mismatch'] == 0 else 'DIFFER'}; the quotient is RN(x / d) "
            f"except for {t['q_mismatch']} pairs, where both are below "
            f"{max(t['max_abs_qref_q_mismatch'], t['max_abs_q_q_mismatch']):.3g} (code 0); of the "
            f"{t['fast_pairs_q_ge_half']} pairs with |x / d| >= 1/2, Markstein's hypotheses fail for "
            f"{t['q0_not_faithful']} (q0 not faithful) and {t['rem_not_exact']} (rem not exact); "
            f"plain x * r gives another code for {t['product_code_mismatch']}; "
            f"{t['slow_pairs']} pairs below the threshold (exact division there; the branch-free form "
            f"would give another quotient for {t['slow_q_mismatch']}, another code for "
            f"{t['slow_code_mismatch']}); largest divisor with another quotient "
            f"{t['max_d_q_mismatch']:.3g}, with another code {t['max_d_code_mismatch']:.3g}"
        )
    print("ALL OK" if ok else "FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
