// CUDA implementations of the zeroq:: INT8 quantization ops (torch glue only).
//
// The schemas are defined in Python (lightning_zeroq/ops/_library.py), which must run before
// this library is loaded; this file only registers CUDA kernels for them. The arithmetic lives
// in quant_int8.cu (torch-free); here: argument checks mirroring reference.py's ValueErrors
// (TORCH_CHECK_VALUE raises ValueError in Python), the device guard, the current stream, and
// the packed-buffer offsets. (c10::cuda::getCurrentCUDAStream is what at::cuda:: re-exports;
// including it from c10 keeps cuBLAS/cuSPARSE headers out of this file.)
//
// Packed layout of one rank's buffer (uint8, n + 4 * n / G bytes):
//   [0, n)                int8 codes
//   [n, n + 4 * n / G)    fp32 scales, native byte order
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "quant_int8.h"

namespace zeroq {
namespace {

FloatKind float_kind(at::ScalarType dtype, const char* what) {
  switch (dtype) {
    case at::kFloat: return FloatKind::kFloat32;
    case at::kBFloat16: return FloatKind::kBFloat16;
    case at::kHalf: return FloatKind::kFloat16;
    default:
      TORCH_CHECK_VALUE(false, "zeroq: ", what, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

void check_group_size(int64_t group_size) {
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0,
                    "zeroq: group_size must be a positive multiple of 8, got ", group_size);
  TORCH_CHECK_VALUE(is_supported_group_size(group_size),
                    "zeroq: group_size ", group_size, " is too large for the CUDA kernels");
}

void check_vector(const at::Tensor& t, const char* what, const at::Tensor& anchor) {
  TORCH_CHECK(t.is_cuda(), "zeroq: ", what, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.device() == anchor.device(), "zeroq: ", what, " is on ", t.device(),
                    " but the input is on ", anchor.device());
  TORCH_CHECK_VALUE(t.dim() == 1, "zeroq: ", what, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "zeroq: ", what, " must be contiguous");
}

void check_multiple(int64_t n, int64_t group_size, const char* what) {
  TORCH_CHECK_VALUE(n % group_size == 0, "zeroq: ", what, " has ", n,
                    " elements, not a multiple of group_size ", group_size,
                    "; pad the shard with zeros to whole groups");
}

// Packed bytes are (n / G) * (G + 4); returns n.
int64_t numel_from_packed(int64_t packed_bytes, int64_t group_size) {
  TORCH_CHECK_VALUE(packed_bytes % (group_size + 4) == 0, "zeroq: a packed buffer of ",
                    packed_bytes, " bytes is not a whole number of groups of ", group_size,
                    " (each group takes ", group_size + 4, " bytes)");
  return packed_bytes / (group_size + 4) * group_size;
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "zeroq: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cuda(const at::Tensor& x, int64_t group_size) {
  check_group_size(group_size);
  check_vector(x, "x", x);
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  const int64_t n = x.numel();
  check_multiple(n, group_size, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor codes = at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({n / group_size}, x.options().dtype(at::kFloat));
  check_launch(launch_quantize_int8(x.data_ptr(), kind, n, group_size, codes.data_ptr<int8_t>(),
                                    scales.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return {codes, scales};
}

void quantize_pack_int8_cuda(const at::Tensor& x, int64_t group_size, at::Tensor& out) {
  check_group_size(group_size);
  check_vector(x, "x", x);
  check_vector(out, "out", x);
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kByte, "zeroq: out must be uint8, got ",
                    out.scalar_type());
  const int64_t n = x.numel();
  check_multiple(n, group_size, "x");
  const int64_t expected = n / group_size * (group_size + 4);
  TORCH_CHECK_VALUE(out.numel() == expected, "zeroq: out must hold exactly ", expected,
                    " bytes for ", n, " elements with group_size ", group_size, ", got ",
                    out.numel());
  const c10::cuda::CUDAGuard guard(x.device());
  uint8_t* bytes = out.data_ptr<uint8_t>();
  check_launch(launch_quantize_int8(x.data_ptr(), kind, n, group_size,
                                    reinterpret_cast<int8_t*>(bytes), bytes + n,
                                    c10::cuda::getCurrentCUDAStream()));
}

at::Tensor dequantize_int8_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                int64_t group_size, at::ScalarType dtype) {
  check_group_size(group_size);
  check_vector(codes, "codes", codes);
  check_vector(scales, "scales", codes);
  const FloatKind kind = float_kind(dtype, "dtype");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kChar, "zeroq: codes must be int8, got ",
                    codes.scalar_type());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat, "zeroq: scales must be float32, got ",
                    scales.scalar_type());
  const int64_t n = codes.numel();
  check_multiple(n, group_size, "codes");
  TORCH_CHECK_VALUE(scales.numel() == n / group_size, "zeroq: expected ", n / group_size,
                    " scales for ", n, " codes with group_size ", group_size, ", got ",
                    scales.numel());
  const c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor out = at::empty({n}, codes.options().dtype(dtype));
  check_launch(launch_dequantize_int8(codes.data_ptr<int8_t>(), scales.data_ptr(), n, group_size,
                                      out.data_ptr(), kind, c10::cuda::getCurrentCUDAStream()));
  return out;
}

void unpack_dequantize_int8_cuda(const at::Tensor& packed, int64_t group_size, at::Tensor& out) {
  check_group_size(group_size);
  check_vector(packed, "packed", packed);
  check_vector(out, "out", packed);
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte, "zeroq: packed must be uint8, got ",
                    packed.scalar_type());
  const FloatKind kind = float_kind(out.scalar_type(), "out");
  const int64_t n = numel_from_packed(packed.numel(), group_size);
  TORCH_CHECK_VALUE(out.numel() == n, "zeroq: a packed buffer of ", packed.numel(),
                    " bytes decodes to ", n, " elements, but out has ", out.numel());
  const c10::cuda::CUDAGuard guard(packed.device());
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  check_launch(launch_dequantize_int8(reinterpret_cast<const int8_t*>(bytes), bytes + n, n,
                                      group_size, out.data_ptr(), kind,
                                      c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroq, CUDA, m) {
  m.impl("quantize_int8", &quantize_int8_cuda);
  m.impl("quantize_pack_int8", &quantize_pack_int8_cuda);
  m.impl("dequantize_int8", &dequantize_int8_cuda);
  m.impl("unpack_dequantize_int8", &unpack_dequantize_int8_cuda);
}

}  // namespace zeroq
