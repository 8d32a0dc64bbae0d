// INT8 group-quantization kernels: quantize (+ pack) and (unpack +) dequantize.
//
// Torch-free on purpose (see quant_int8.h): the torch glue in ops.cpp passes raw pointers.
// The numerical specification is lightning_zeroq/ops/reference.py; these kernels must produce
// bitwise the same codes, scales and decoded values, so every operation below mirrors one line
// of the reference:
//   absmax  = max |x| over the group, in fp32            (max_nan/fabsf: exact, order-free, NaN
//                                                          if any element is NaN, like torch.amax)
//   scale   = absmax / 127                                (__fdiv_rn: IEEE division, immune to
//                                                          --use_fast_math; 16-bit input: the
//                                                          same by a remainder step, scale_of_input)
//             or NaN (0x7fc00000) if absmax is inf/NaN    (the group decodes to NaN)
//   divisor = scale, or 1 where scale == 0                (all-zero groups give codes 0, no NaN)
//   code    = clamp(rint(x / divisor), -127, 127)         (fp32: x * (1 / divisor), rounded half
//                                                          to even; the exact __fdiv_rn decides
//                                                          near half-integers; bf16/fp16: that
//                                                          product corrected by one remainder step,
//                                                          no test: see encode8, encode_remainder)
//             or 0 where x / divisor is NaN               (only in a group whose scale is NaN)
//   decode  = float(code) * scale, rounded to the output  (__fmul_rn, then a round-to-nearest-even
//             dtype                                        conversion, as torch's .to(dtype))
// Non-finite input propagates: a group holding NaN or +-inf gets scale NaN and codes 0, so all of
// it decodes to NaN, as the reference does. (fmaxf would drop a NaN, and a NaN master would turn
// into a finite working weight: the loss stays finite while masters and checkpoints hold NaN.)
// Why this costs nothing measurable (read off the sm_90 SASS before and after; not timed): nothing
// is added per element. max.NaN.f32 is the same FMNMX instruction as fmaxf (with a NaN flag, |x|
// still an operand modifier), and the near-tie test of encode8 becomes an unordered compare,
// the same FSETP. Codes of a non-finite group need no code in the fast path: its NaN scale makes
// the reciprocal and every product NaN, the unordered test sends NaN products to the exact
// division, and there a NaN quotient encodes to 0 (slow, but only in groups already broken). Per
// group and lane the scale takes one compare and one select, against more than 100 instructions a
// lane issues per group of 64 in the instruction-bound 16-bit quantize (about 1%, at most). A
// conditional division or a branch to store zero codes cost 3-4 times as many (barriers).
//
// Work split. Every group size G is a multiple of 8, so the unit of work is a "chunk" of 8
// consecutive elements: one 16-byte load of bf16/fp16 (two of fp32), 8 code bytes (one 8-byte
// access, or two 4-byte ones where the codes are only 4-byte aligned). A group of C = G / 8
// chunks is handled by a *team* of kTeam lanes of one warp (kTeam = the largest power of two
// <= 32 dividing C); lane l takes chunks l, l + kTeam, ..., so a warp touches contiguous memory.
// The team reduces absmax with warp shuffles. When C == kTeam (G = 8..256 in powers of two; 64
// is the default: 8 lanes per group, 4 groups per warp) each lane's chunk stays in registers
// between the absmax and the encode, and a team takes kUnroll groups per iteration with all
// their loads issued first, to keep more bytes in flight; other group sizes take two passes (the
// second re-reads the group from L1/L2). Quantize grids are at most one wave of resident blocks,
// which loop over the groups; dequantize launches a full grid (see dequantize_kernel).
//
// Alignment. The fast kernels need 16-byte aligned floating-point data and 4-byte aligned code
// and scale addresses (quantize stores 8-byte aligned codes with single 8-byte accesses). A rank's slice of a gathered packed buffer starts at a multiple of
// n * (G + 4) / G bytes, which is 4-byte aligned when the buffer is, so the fast path covers the
// quantized gather; anything else (odd storage offsets) runs a simple element-wise kernel with
// the same arithmetic.
#include "quant_int8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace zeroq {
namespace {

constexpr int kThreads = 256;            // threads per block
constexpr int kChunk = 8;                // elements per lane and step; divides every group size
constexpr int64_t kMaxBlocks = 1 << 20;  // cap of a full grid; beyond it, grid-stride loops
// Groups per team and iteration in the G == 8 * team kernels. Four for 16-bit inputs (as many bytes
// in flight per lane as fp32's two) measured slower (benchmarks/results/quant_kernels_variants_*).
constexpr int kUnroll = 2;
constexpr float kQMax = 127.0f;
// The scale of a group holding NaN or +-inf: torch's float('nan'), so that packed buffers are
// bitwise the same on every backend (GPU arithmetic would produce 0x7fffffff, x86 0xffc00000).
constexpr uint32_t kNonFiniteScaleBits = 0x7fc00000u;

// ---- element formats: 8-element vector load/store and scalar conversions ----------------------

template <typename T>
struct Format;

template <>
struct Format<float> {
  static __device__ __forceinline__ void load8(const float* p, float (&v)[kChunk]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
  static __device__ __forceinline__ void store8(float* p, const float (&v)[kChunk]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

// 16-bit formats travel as uint4 = four 32-bit words of two elements each (element 2i in the low
// half of word i: little-endian, like the tensor's memory).
template <>
struct Format<__nv_bfloat16> {
  static __device__ __forceinline__ float2 unpack2(uint32_t w) {
    // bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo, .y = hi; RNE
    uint32_t w;
    memcpy(&w, &h, sizeof(w));
    return w;
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct Format<__half> {
  static __device__ __forceinline__ float2 unpack2(uint32_t w) {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);  // exact
  }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);  // RNE, overflow to inf like torch
    uint32_t w;
    memcpy(&w, &h, sizeof(w));
    return w;
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kChunk]) {
  if constexpr (sizeof(T) == 4) {
    Format<T>::load8(p, v);
  } else {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = Format<T>::unpack2(words[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[kChunk]) {
  if constexpr (sizeof(T) == 4) {
    Format<T>::store8(p, v);
  } else {
    uint4 raw;
    raw.x = Format<T>::pack2(v[0], v[1]);
    raw.y = Format<T>::pack2(v[2], v[3]);
    raw.z = Format<T>::pack2(v[4], v[5]);
    raw.w = Format<T>::pack2(v[6], v[7]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

// ---- the arithmetic of the format (mirrors reference.py line by line) -------------------------

// max(a, b) of two magnitudes (sign bit clear), NaN if either is NaN; fmaxf would return the other.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  // No max.NaN before sm_80: for magnitudes the integer order of the bits is the float order, and
  // every NaN (0x7f800001 and up) sorts above +inf (0x7f800000).
  return __int_as_float(max(__float_as_int(a), __float_as_int(b)));
#endif
}

// The division runs unconditionally and a select picks the result: a conditional division
// compiles to a branch with convergence barriers, several instructions more per group.
__device__ __forceinline__ float scale_of(float absmax) {
  const float scale = __fdiv_rn(absmax, kQMax);
  return absmax <= FLT_MAX ? scale : __uint_as_float(kNonFiniteScaleBits);  // false for inf, NaN
}

// scale_of for the absmax of 16-bit input (a bfloat16 or float16 value, or inf/NaN), in three
// instructions instead of __fdiv_rn's five with a range check (FCHK) and a branch: q0 = RN(absmax * c),
// c = RN(1/127), corrected by one remainder step as in encode_remainder. That is RN(absmax / 127) for
// every finite bfloat16 and float16 value, subnormals included (all 64382 checked:
// tests/ops/quotient_exhaustive.py); inf and NaN get the NaN scale as in scale_of.
template <typename T>
__device__ __forceinline__ float scale_of_input(float absmax) {
  if constexpr (sizeof(T) == 2) {
    constexpr float kInverse = 1.0f / kQMax;  // RN(1/127), folded by the compiler
    const float q0 = __fmul_rn(absmax, kInverse);
    const float rem = __fmaf_rn(-q0, kQMax, absmax);
    const float scale = __fmaf_rn(rem, kInverse, q0);
    return absmax <= FLT_MAX ? scale : __uint_as_float(kNonFiniteScaleBits);  // false for inf, NaN
  } else {
    return scale_of(absmax);
  }
}

__device__ __forceinline__ float divisor_of(float scale) { return scale == 0.0f ? 1.0f : scale; }

// Clamps in float, then rounds half to even by adding 1.5 * 2^23: at that magnitude the float
// spacing is 1, so the addition rounds (RNE) and the low mantissa bits hold the integer. Same
// result as rint-then-clamp, without a float-to-int conversion (a quarter-rate instruction).
__device__ __forceinline__ int round_clamped(float q) {
  q = fminf(fmaxf(q, -kQMax), kQMax);
  return __float_as_int(__fadd_rn(q, 12582912.0f)) - 0x4B400000;
}

// A NaN quotient (only where the divisor is a non-finite group's NaN scale) encodes to 0; the clamp
// alone would make it -127.
__device__ __forceinline__ int encode(float x, float divisor) {
  const float q = __fdiv_rn(x, divisor);
  return round_clamped(q == q ? q : 0.0f);
}

// The reciprocal used by encode8, or 0 where it would overflow (a subnormal divisor): then
// every element takes the exact division.
__device__ __forceinline__ float reciprocal_of(float divisor) {
  const float r = __frcp_rn(divisor);
  return isinf(r) ? 0.0f : r;
}

// encode(x, divisor) bitwise for the 8 values of a chunk, with a multiplication in place of the
// division, each as a word whose low byte is the code (two's complement; the other bytes are not
// defined). p = x * (1/d), both correctly rounded, differs from the rounded quotient x / d by at
// most 3 * 2^-24 relative, i.e. less than 2.3e-5 for |x / d| <= 127.5; so unless p lies within
// 2^-14 of a half-integer, both round to the same integer. Near a half-integer (about one element
// in 8000 of random data, one chunk in 1000) the exact division decides, for the whole chunk: one
// rarely taken branch per chunk instead of one per element (each branch brings its convergence
// barrier; the 16-bit quantize is instruction-bound). No clamp is needed: |x| <= absmax makes
// |p| <= 127.0001, which rounds into [-127, 127] as the clamped quotient does. Adding 1.5 * 2^23
// rounds half to even and leaves the integer in the low mantissa bits, so the code byte is the low
// byte of the sum's bits. The test is written `!(... <= ...)` so that a NaN product (a non-finite
// group: its divisor and reciprocal are NaN) takes the exact division too, which encodes it to 0;
// a zero reciprocal (a subnormal divisor) sends every chunk there.
// The low bytes of four words, in order, as one word (three byte permutes).
__device__ __forceinline__ uint32_t pack_low_bytes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// encode(x, divisor) bitwise, with a multiplication in place of the division, as a word whose low
// byte is the code (two's complement; the other bytes are not defined). p = x * (1/d), both
// correctly rounded, differs from the rounded quotient x / d by at most 3 * 2^-24 relative, i.e.
// less than 2.3e-5 for |x / d| <= 127.5; so unless p lies within 2^-14 of a half-integer, both round
// to the same integer. Near a half-integer (about one element in 8000 of random data) the exact
// division decides. No clamp is needed: |x| <= absmax makes |p| <= 127.0001, which rounds into
// [-127, 127] as the clamped quotient does. Adding 1.5 * 2^23 rounds half to even and leaves the
// integer in the low mantissa bits, so the code byte is the low byte of the sum's bits. The test is
// written `!(... <= ...)` so that a NaN product (a non-finite group: its divisor and reciprocal are
// NaN) takes the exact division too, which encodes it to 0; a zero reciprocal (a subnormal divisor)
// sends every element there.
__device__ __forceinline__ bool near_tie(float p, float shifted) {
  return !(fabsf(__fsub_rn(p, __fsub_rn(shifted, 12582912.0f))) <= 0.5f - 0x1p-14f);
}

__device__ __forceinline__ uint32_t encode_fast(float x, float divisor, float reciprocal) {
  const float p = __fmul_rn(x, reciprocal);
  const float shifted = __fadd_rn(p, 12582912.0f);
  if (reciprocal == 0.0f || near_tie(p, shifted)) return static_cast<uint32_t>(encode(x, divisor));
  return __float_as_uint(shifted);
}

// How encode8 makes the codes of a chunk, per element type (EncodeMode below):
//   kPerElement: encode_fast per element (a near-tie test and a rarely taken branch each);
//   kPerChunk: one near-tie test and one rarely taken branch per chunk (the whole chunk then
//     takes the exact division);
//   kRemainder: no test per element (see encode_remainder), one branch per chunk on the divisor.
enum class Mode { kPerElement, kPerChunk, kRemainder };

// Divisors from which kRemainder is exact (below, the remainder can underflow and lose bits; only
// bfloat16 input gets there, with absmax < 127 * 2^-100, about 1e-28).
constexpr float kMinRemainderDivisor = 0x1p-100f;

// encode(x, d) bitwise for 16-bit x (bfloat16, float16) and a divisor d >= kMinRemainderDivisor,
// with r = RN(1 / d), without a test or a branch: q0 = RN(x * r), rem = RN(x - q0 * d) (an fma),
// q = RN(q0 + rem * r) (an fma) is the correctly rounded quotient RN(x / d) wherever |x / d| >= 2^-10
// (and below 1/2 elsewhere, code 0 both), so that its rounding to an integer is the reference's.
// This is Markstein's correction step; his theorem's hypothesis (q0 a faithful quotient) does not
// hold for every pair, so the claim rests on an exhaustive check instead: every x of bfloat16 and of
// float16 against every absmax >= |x| of the same format, whose scale RN(absmax / 127) is the only
// divisor x can meet (tests/ops/quotient_exhaustive.py; 5.3e8 and 5.0e8 pairs, negative x mirror).
// No clamp: |x| <= absmax bounds |q| by 127.00001. Adding 1.5 * 2^23 rounds half to even as in
// encode_fast. Not for float32 input (not checked; it is memory-bound and keeps kPerElement).
__device__ __forceinline__ uint32_t encode_remainder(float x, float divisor, float reciprocal) {
  const float q0 = __fmul_rn(x, reciprocal);
  const float rem = __fmaf_rn(-q0, divisor, x);
  const float q = __fmaf_rn(rem, reciprocal, q0);
  return __float_as_uint(__fadd_rn(q, 12582912.0f));
}

// The codes of a chunk, two words of four. kPerChunk: faster than kPerElement for fp16 but slower for
// bf16 (benchmarks/results/quant_kernels_chunk_branch_*): bfloat16 data has exact ties
// often (an 8-bit significand over a scale absmax / 127: 0.3% of the elements of random data, 2.3% of
// the chunks, one warp step in two), and every tie sends its whole chunk to eight divisions.
// kRemainder has no ties to branch for; a non-finite group (NaN divisor: the comparison is false) or
// a divisor below kMinRemainderDivisor takes the exact division for the chunk.
template <Mode kMode>
__device__ __forceinline__ uint2 encode8(const float (&v)[kChunk], float divisor, float reciprocal) {
  if constexpr (kMode == Mode::kPerElement) {
    return make_uint2(pack_low_bytes4(encode_fast(v[0], divisor, reciprocal), encode_fast(v[1], divisor, reciprocal),
                                      encode_fast(v[2], divisor, reciprocal), encode_fast(v[3], divisor, reciprocal)),
                      pack_low_bytes4(encode_fast(v[4], divisor, reciprocal), encode_fast(v[5], divisor, reciprocal),
                                      encode_fast(v[6], divisor, reciprocal), encode_fast(v[7], divisor, reciprocal)));
  } else {
    uint32_t w[kChunk];
    bool exact;
    if constexpr (kMode == Mode::kPerChunk) {
      exact = reciprocal == 0.0f;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const float p = __fmul_rn(v[i], reciprocal);
        const float shifted = __fadd_rn(p, 12582912.0f);
        w[i] = __float_as_uint(shifted);
        exact |= near_tie(p, shifted);
      }
    } else {
      exact = !(divisor >= kMinRemainderDivisor);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) w[i] = encode_remainder(v[i], divisor, reciprocal);
    }
    if (exact) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) w[i] = static_cast<uint32_t>(encode(v[i], divisor));
    }
    return make_uint2(pack_low_bytes4(w[0], w[1], w[2], w[3]), pack_low_bytes4(w[4], w[5], w[6], w[7]));
  }
}

template <typename T>
struct EncodeMode : std::integral_constant<Mode, sizeof(T) == 2 ? Mode::kRemainder : Mode::kPerElement> {};

// The reciprocal encode8 takes: kRemainder uses it only where divisor >= kMinRemainderDivisor, where
// it is finite, so it needs no test for overflow.
template <typename T>
__device__ __forceinline__ float reciprocal_for(float divisor) {
  if constexpr (EncodeMode<T>::value == Mode::kRemainder) {
    return __frcp_rn(divisor);
  } else {
    return reciprocal_of(divisor);
  }
}

__device__ __forceinline__ float decode(int code, float scale) {
  return __fmul_rn(static_cast<float>(code), scale);
}

__device__ __forceinline__ int code_at(uint32_t word, int byte) {
  return static_cast<int>(static_cast<int8_t>(static_cast<uint8_t>(word >> (8 * byte))));
}

template <int kTeam>
__device__ __forceinline__ float team_max(float v) {
#pragma unroll
  for (int offset = kTeam / 2; offset > 0; offset /= 2) {
    v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, offset, kTeam));
  }
  return v;
}

// ---- fast kernels -----------------------------------------------------------------------------

// `r` is reciprocal_of(divisor), computed once per group by the caller.
template <typename T>
__device__ __forceinline__ void store_codes8(int8_t* p, const float (&v)[kChunk], float divisor, float r,
                                             bool aligned8) {
  const uint2 codes = encode8<EncodeMode<T>::value>(v, divisor, r);
  const uint32_t lo = codes.x, hi = codes.y;
  if (aligned8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
  } else {  // a rank's slice of a gathered buffer may be only 4-byte aligned
    reinterpret_cast<uint32_t*>(p)[0] = lo;
    reinterpret_cast<uint32_t*>(p)[1] = hi;
  }
}

template <typename T>
__device__ __forceinline__ void decode8(uint2 words, float scale, T* out) {
  float v[kChunk];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = decode(code_at(words.x, i), scale);
    v[4 + i] = decode(code_at(words.y, i), scale);
  }
  store8(out, v);
}

// G == 8 * kTeam: each lane owns one chunk of a group, so its values stay in registers between
// the absmax and the encode. A team takes kUnroll groups per iteration (kGroupsPerBlock apart) and
// issues all their loads before the first use, to keep more bytes in flight.
// Six blocks of 256 threads resident per SM (40 registers at most, no spills): without the bound the
// 16-bit kernels take 42-47 registers, which leaves room for five.
template <typename T, int kTeam>
__global__ void __launch_bounds__(kThreads, 6)
    quantize_one_chunk_kernel(const T* __restrict__ x, int64_t num_groups,
                              int8_t* __restrict__ codes, float* __restrict__ scales,
                              bool codes_aligned8) {
  constexpr int kGroupsPerBlock = kThreads / kTeam;
  const int lane = threadIdx.x % kTeam;
  const int team = threadIdx.x / kTeam;
  // `first` is uniform across the block, so all 32 lanes of a warp reach the shuffles together.
  for (int64_t first = int64_t(blockIdx.x) * kGroupsPerBlock * kUnroll; first < num_groups;
       first += int64_t(gridDim.x) * kGroupsPerBlock * kUnroll) {
    float v[kUnroll][kChunk];
    float absmax[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t group = first + u * kGroupsPerBlock + team;
      absmax[u] = 0.0f;
      if (group < num_groups) load8(x + (group * kTeam + lane) * kChunk, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t group = first + u * kGroupsPerBlock + team;
      if (group < num_groups) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) absmax[u] = max_nan(absmax[u], fabsf(v[u][i]));
      }
      absmax[u] = team_max<kTeam>(absmax[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t group = first + u * kGroupsPerBlock + team;
      if (group >= num_groups) continue;
      const float scale = scale_of_input<T>(absmax[u]);
      const float divisor = divisor_of(scale);
      store_codes8<T>(codes + (group * kTeam + lane) * kChunk, v[u], divisor, reciprocal_for<T>(divisor),
                   codes_aligned8);
      if (lane == 0) scales[group] = scale;
    }
  }
}

// Any G: a lane takes chunks lane, lane + kTeam, ... of the group, in two passes (absmax, then
// encode; the second pass re-reads the group from L1/L2).
template <typename T, int kTeam>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, int64_t num_groups, int chunks_per_group,
                    int8_t* __restrict__ codes, float* __restrict__ scales, bool codes_aligned8) {
  constexpr int kGroupsPerBlock = kThreads / kTeam;
  const int lane = threadIdx.x % kTeam;
  const int team = threadIdx.x / kTeam;
  const int chunks_per_lane = chunks_per_group / kTeam;
  for (int64_t first = int64_t(blockIdx.x) * kGroupsPerBlock; first < num_groups;
       first += int64_t(gridDim.x) * kGroupsPerBlock) {
    const int64_t group = first + team;
    const bool active = group < num_groups;
    const int64_t lane_chunk = group * chunks_per_group + lane;
    float v[kChunk];
    float absmax = 0.0f;
    if (active) {
      for (int k = 0; k < chunks_per_lane; ++k) {
        load8(x + (lane_chunk + int64_t(k) * kTeam) * kChunk, v);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) absmax = max_nan(absmax, fabsf(v[i]));
      }
    }
    absmax = team_max<kTeam>(absmax);
    if (!active) continue;

    const float scale = scale_of_input<T>(absmax);
    const float divisor = divisor_of(scale);
    const float reciprocal = reciprocal_for<T>(divisor);
    for (int k = 0; k < chunks_per_lane; ++k) {
      const int64_t chunk = lane_chunk + int64_t(k) * kTeam;
      load8(x + chunk * kChunk, v);
      store_codes8<T>(codes + chunk * kChunk, v, divisor, reciprocal, codes_aligned8);
    }
    if (lane == 0) scales[group] = scale;
  }
}

// Same team layout (no reduction needed; it gives each lane its group's scale without an
// integer division). Unlike quantize, this kernel runs best as launched here: a full grid (one
// iteration per team for G <= 256) and two 4-byte code loads per chunk; a persistent grid with two
// groups per team in flight and 8-byte loads measured slower (benchmarks/results/quant_kernels_variants_*).
// fp32 output writes four bytes per code byte, so its stores decide the speed: there a lane takes
// quads (4 elements: one 4-byte code load, one 16-byte store) l, l + kTeam, ..., so that each
// store instruction of a team covers whole consecutive 32-byte sectors instead of every other
// half-sector.
template <typename T, int kTeam>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const int8_t* __restrict__ codes, const float* __restrict__ scales,
                      int64_t num_groups, int chunks_per_group, T* __restrict__ out) {
  constexpr int kGroupsPerBlock = kThreads / kTeam;
  const int lane = threadIdx.x % kTeam;
  const int team = threadIdx.x / kTeam;
  const int chunks_per_lane = chunks_per_group / kTeam;
  for (int64_t group = int64_t(blockIdx.x) * kGroupsPerBlock + team; group < num_groups;
       group += int64_t(gridDim.x) * kGroupsPerBlock) {
    const float scale = __ldg(scales + group);
    if constexpr (sizeof(T) == 4) {
      const int64_t lane_quad = group * chunks_per_group * 2 + lane;
      for (int k = 0; k < 2 * chunks_per_lane; ++k) {
        const int64_t quad = lane_quad + int64_t(k) * kTeam;
        const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(codes) + quad);
        reinterpret_cast<float4*>(out)[quad] =
            make_float4(decode(code_at(word, 0), scale), decode(code_at(word, 1), scale),
                        decode(code_at(word, 2), scale), decode(code_at(word, 3), scale));
      }
    } else {
      const int64_t lane_chunk = group * chunks_per_group + lane;
      for (int k = 0; k < chunks_per_lane; ++k) {
        const int64_t chunk = lane_chunk + int64_t(k) * kTeam;
        const uint32_t* in = reinterpret_cast<const uint32_t*>(codes + chunk * kChunk);
        decode8(make_uint2(__ldg(in), __ldg(in + 1)), scale, out + chunk * kChunk);
      }
    }
  }
}

// ---- element-wise kernels for unaligned addresses (same arithmetic, scalar memory access) ----

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_unaligned_kernel(const T* __restrict__ x, int64_t num_groups, int64_t group_size,
                              int8_t* __restrict__ codes, unsigned char* __restrict__ scale_bytes) {
  for (int64_t group = int64_t(blockIdx.x) * kThreads + threadIdx.x; group < num_groups;
       group += int64_t(gridDim.x) * kThreads) {
    const T* in = x + group * group_size;
    float absmax = 0.0f;
    for (int64_t i = 0; i < group_size; ++i) absmax = max_nan(absmax, fabsf(Format<T>::to_float(in[i])));
    const float scale = scale_of(absmax);
    const float divisor = divisor_of(scale);
    for (int64_t i = 0; i < group_size; ++i) {
      codes[group * group_size + i] = static_cast<int8_t>(encode(Format<T>::to_float(in[i]), divisor));
    }
    memcpy(scale_bytes + group * sizeof(float), &scale, sizeof(float));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_unaligned_kernel(const int8_t* __restrict__ codes,
                                const unsigned char* __restrict__ scale_bytes, int64_t n,
                                int64_t group_size, T* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    float scale;
    memcpy(&scale, scale_bytes + (i / group_size) * sizeof(float), sizeof(float));
    out[i] = Format<T>::from_float(decode(codes[i], scale));
  }
}

// ---- launchers --------------------------------------------------------------------------------

bool is_aligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

int sm_count() {
  static int counts[256] = {};  // per device; 0 = not read yet (a benign race: same value)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 256) return 132;
  if (counts[device] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return 132;
    }
    counts[device] = count;
  }
  return counts[device];
}

template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0) != cudaSuccess ||
      blocks <= 0) {
    return 1;
  }
  return blocks;
}

// Enough blocks to cover the work, at most one full wave of resident blocks (the kernels loop):
// many short-lived blocks cost more than a loop. `resident` is blocks per SM for the kernel.
unsigned int blocks_for(int64_t items, int64_t items_per_block, int resident) {
  const int64_t wave = int64_t(sm_count()) * resident;
  const int64_t blocks = (items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned int>(blocks < wave ? blocks : wave);
}

// One block per kGroupsPerBlock groups (the kernels still loop past kMaxBlocks).
unsigned int full_grid(int64_t items, int64_t items_per_block) {
  const int64_t blocks = (items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Calls launch(std::integral_constant<int, kTeam>) with kTeam the largest power of two <= 32 that
// divides the chunk count of a group (the kernels' team size is a template argument).
template <typename Launch>
cudaError_t with_team_size(int chunks_per_group, Launch&& launch) {
  int team = 1;
  while (team < 32 && chunks_per_group % (2 * team) == 0) team *= 2;
  switch (team) {
    case 1: return launch(std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, 2>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    case 8: return launch(std::integral_constant<int, 8>{});
    case 16: return launch(std::integral_constant<int, 16>{});
    default: return launch(std::integral_constant<int, 32>{});
  }
}

// The occupancy queries run once per kernel (function-local statics of each instantiation).
template <typename T, int kTeam>
cudaError_t launch_quantize_team(const T* x, int64_t num_groups, int chunks_per_group,
                                 int8_t* codes, float* scales, cudaStream_t stream) {
  const bool codes8 = is_aligned(codes, 8);
  if (chunks_per_group == kTeam) {
    static const int resident = resident_blocks_per_sm(quantize_one_chunk_kernel<T, kTeam>);
    const unsigned int blocks = blocks_for(num_groups, kUnroll * kThreads / kTeam, resident);
    quantize_one_chunk_kernel<T, kTeam>
        <<<blocks, kThreads, 0, stream>>>(x, num_groups, codes, scales, codes8);
  } else {
    static const int resident = resident_blocks_per_sm(quantize_kernel<T, kTeam>);
    const unsigned int blocks = blocks_for(num_groups, kThreads / kTeam, resident);
    quantize_kernel<T, kTeam>
        <<<blocks, kThreads, 0, stream>>>(x, num_groups, chunks_per_group, codes, scales, codes8);
  }
  return cudaGetLastError();
}

template <typename T, int kTeam>
cudaError_t launch_dequantize_team(const int8_t* codes, const float* scales, int64_t num_groups,
                                   int chunks_per_group, T* out, cudaStream_t stream) {
  dequantize_kernel<T, kTeam><<<full_grid(num_groups, kThreads / kTeam), kThreads, 0, stream>>>(
      codes, scales, num_groups, chunks_per_group, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t quantize_as(const T* x, int64_t n, int64_t group_size, int8_t* codes, void* scales,
                        cudaStream_t stream) {
  const int64_t num_groups = n / group_size;
  if (!(is_aligned(x, 16) && is_aligned(codes, 4) && is_aligned(scales, 4))) {
    static const int resident = resident_blocks_per_sm(quantize_unaligned_kernel<T>);
    quantize_unaligned_kernel<T><<<blocks_for(num_groups, kThreads, resident), kThreads, 0, stream>>>(
        x, num_groups, group_size, codes, static_cast<unsigned char*>(scales));
    return cudaGetLastError();
  }
  const int chunks = static_cast<int>(group_size / kChunk);
  float* s = static_cast<float*>(scales);
  return with_team_size(chunks, [&](auto team) {
    return launch_quantize_team<T, decltype(team)::value>(x, num_groups, chunks, codes, s, stream);
  });
}

template <typename T>
cudaError_t dequantize_as(const int8_t* codes, const void* scales, int64_t n, int64_t group_size,
                          T* out, cudaStream_t stream) {
  if (!(is_aligned(codes, 4) && is_aligned(scales, 4) && is_aligned(out, 16))) {
    static const int resident = resident_blocks_per_sm(dequantize_unaligned_kernel<T>);
    dequantize_unaligned_kernel<T><<<blocks_for(n, kThreads, resident), kThreads, 0, stream>>>(
        codes, static_cast<const unsigned char*>(scales), n, group_size, out);
    return cudaGetLastError();
  }
  const int64_t num_groups = n / group_size;
  const int chunks = static_cast<int>(group_size / kChunk);
  const float* s = static_cast<const float*>(scales);
  return with_team_size(chunks, [&](auto team) {
    return launch_dequantize_team<T, decltype(team)::value>(codes, s, num_groups, chunks, out, stream);
  });
}

bool valid_shape(int64_t n, int64_t group_size) {
  return is_supported_group_size(group_size) && n >= 0 && n % group_size == 0;
}

}  // namespace

bool is_supported_group_size(int64_t group_size) {
  return group_size > 0 && group_size % kChunk == 0 && group_size <= INT_MAX;
}

cudaError_t launch_quantize_int8(const void* x, FloatKind x_kind, int64_t n, int64_t group_size,
                                 int8_t* codes, void* scales, cudaStream_t stream) {
  if (!valid_shape(n, group_size)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || codes == nullptr || scales == nullptr) return cudaErrorInvalidValue;
  switch (x_kind) {
    case FloatKind::kFloat32:
      return quantize_as(static_cast<const float*>(x), n, group_size, codes, scales, stream);
    case FloatKind::kBFloat16:
      return quantize_as(static_cast<const __nv_bfloat16*>(x), n, group_size, codes, scales, stream);
    case FloatKind::kFloat16:
      return quantize_as(static_cast<const __half*>(x), n, group_size, codes, scales, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_dequantize_int8(const int8_t* codes, const void* scales, int64_t n,
                                   int64_t group_size, void* out, FloatKind out_kind,
                                   cudaStream_t stream) {
  if (!valid_shape(n, group_size)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (codes == nullptr || scales == nullptr || out == nullptr) return cudaErrorInvalidValue;
  switch (out_kind) {
    case FloatKind::kFloat32:
      return dequantize_as(codes, scales, n, group_size, static_cast<float*>(out), stream);
    case FloatKind::kBFloat16:
      return dequantize_as(codes, scales, n, group_size, static_cast<__nv_bfloat16*>(out), stream);
    case FloatKind::kFloat16:
      return dequantize_as(codes, scales, n, group_size, static_cast<__half*>(out), stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace zeroq
