// Launcher API for the INT8 group-quantization kernels (csrc/quant_int8.cu).
//
// This header is deliberately free of torch headers: quant_int8.cu compiles with plain nvcc
// (`nvcc -std=c++17 -arch=sm_90 -c csrc/quant_int8.cu`), and only ops.cpp knows about tensors.
//
// Format (the specification is lightning_zeroq/ops/reference.py): a 1-D shard of n elements,
// n a multiple of the group size G (a positive multiple of 8), is cut into n / G groups of G
// consecutive elements. Per group, scale = absmax / 127 in fp32; code = clamp(rint(x / scale),
// -127, 127) with round-half-to-even and a true (IEEE) division; a group with scale 0 gets
// codes 0; a group holding NaN or +-inf gets scale NaN (0x7fc00000) and codes 0. Decode is
// code * scale in fp32, then rounded to the output dtype.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace zeroq {

// The floating-point formats the kernels read and write.
enum class FloatKind : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

// True when group_size is a positive multiple of 8 that the kernels can index with 32-bit
// per-group counters (group_size <= 2^31 - 1).
bool is_supported_group_size(int64_t group_size);

// Quantizes x[0:n) (n a multiple of group_size) into codes[0:n) and n / group_size fp32 scales.
// `scales` is a byte address: in the packed layout it follows the codes, so it may be only
// byte-aligned (an unaligned fallback kernel handles that). Enqueues on `stream`; returns the
// launch error, or cudaErrorInvalidValue for bad arguments. n == 0 launches nothing.
cudaError_t launch_quantize_int8(const void* x, FloatKind x_kind, int64_t n, int64_t group_size,
                                 int8_t* codes, void* scales, cudaStream_t stream);

// Decodes codes[0:n) with n / group_size fp32 scales (byte address, see above) into out[0:n)
// of format out_kind. Enqueues on `stream`; same error convention as above.
cudaError_t launch_dequantize_int8(const int8_t* codes, const void* scales, int64_t n,
                                   int64_t group_size, void* out, FloatKind out_kind,
                                   cudaStream_t stream);

}  // namespace zeroq
