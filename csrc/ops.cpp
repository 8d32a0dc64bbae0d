// CUDA implementations of the zeroq:: ops: INT8 quantization, the checked gradient widening (torch glue only).
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
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "quant_int8.h"
#include "widen.h"

namespace zeroq {
namespace {

// Error messages are built here as one std::string and passed to TORCH_CHECK as its only message
// argument, which c10::str returns untouched. Streaming an integer through c10::str's
// ostringstream from inside this library crashed (SIGSEGV in libstdc++'s num_put, in the library's
// own copy of it) on the H200 machine with torch 2.11+cu130 and g++ 13; strings are safe.
std::string num(int64_t value) { return std::to_string(value); }

std::string shape_of(const at::Tensor& t) {
  std::string shape = "[";
  for (int64_t d = 0; d < t.dim(); ++d) shape += (d ? ", " : "") + num(t.size(d));
  return shape + "]";
}

FloatKind float_kind(at::ScalarType dtype, const std::string& what) {
  switch (dtype) {
    case at::kFloat: return FloatKind::kFloat32;
    case at::kBFloat16: return FloatKind::kBFloat16;
    case at::kHalf: return FloatKind::kFloat16;
    default: break;
  }
  C10_THROW_ERROR(ValueError, "zeroq: " + what + " must be float32, bfloat16 or float16, got " +
                                  std::string(c10::toString(dtype)));
}

void check_group_size(int64_t group_size) {
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0,
                    "zeroq: group_size must be a positive multiple of 8, got " + num(group_size));
  TORCH_CHECK_VALUE(is_supported_group_size(group_size),
                    "zeroq: group_size " + num(group_size) + " is too large for the CUDA kernels");
}

void check_vector(const at::Tensor& t, const std::string& what, const at::Tensor& anchor) {
  TORCH_CHECK(t.is_cuda(),
              "zeroq: " + what + " must be a CUDA tensor, got device " + t.device().str());
  TORCH_CHECK_VALUE(t.device() == anchor.device(), "zeroq: " + what + " is on " +
                                                       t.device().str() + " but the input is on " +
                                                       anchor.device().str());
  TORCH_CHECK_VALUE(t.dim() == 1, "zeroq: " + what + " must be 1-D, got shape " + shape_of(t));
  TORCH_CHECK_VALUE(t.is_contiguous(), "zeroq: " + what + " must be contiguous");
}

void check_dtype(const at::Tensor& t, at::ScalarType expected, const std::string& what) {
  TORCH_CHECK_VALUE(t.scalar_type() == expected,
                    "zeroq: " + what + " must be " + c10::toString(expected) + ", got " +
                        c10::toString(t.scalar_type()));
}

void check_multiple(int64_t n, int64_t group_size, const std::string& what) {
  TORCH_CHECK_VALUE(n % group_size == 0, "zeroq: " + what + " has " + num(n) +
                                             " elements, not a multiple of group_size " +
                                             num(group_size) +
                                             "; pad the shard with zeros to whole groups");
}

// Packed bytes are (n / G) * (G + 4); returns n.
int64_t numel_from_packed(int64_t packed_bytes, int64_t group_size) {
  TORCH_CHECK_VALUE(packed_bytes % (group_size + 4) == 0,
                    "zeroq: a packed buffer of " + num(packed_bytes) +
                        " bytes is not a whole number of groups of " + num(group_size) +
                        " (each group takes " + num(group_size + 4) + " bytes)");
  return packed_bytes / (group_size + 4) * group_size;
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess,
              std::string("zeroq: CUDA kernel launch failed: ") + cudaGetErrorString(err));
}

void quantize_pack_int8_cuda(const at::Tensor& x, int64_t group_size, at::Tensor& out) {
  check_group_size(group_size);
  check_vector(x, "x", x);
  check_vector(out, "out", x);
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  check_dtype(out, at::kByte, "out");
  const int64_t n = x.numel();
  check_multiple(n, group_size, "x");
  const int64_t expected = n / group_size * (group_size + 4);
  TORCH_CHECK_VALUE(out.numel() == expected,
                    "zeroq: out must hold exactly " + num(expected) + " bytes for " + num(n) +
                        " elements with group_size " + num(group_size) + ", got " +
                        num(out.numel()));
  const c10::cuda::CUDAGuard guard(x.device());
  uint8_t* bytes = out.data_ptr<uint8_t>();
  check_launch(launch_quantize_int8(x.data_ptr(), kind, n, group_size,
                                    reinterpret_cast<int8_t*>(bytes), bytes + n,
                                    c10::cuda::getCurrentCUDAStream()));
}

void unpack_dequantize_int8_cuda(const at::Tensor& packed, int64_t group_size, at::Tensor& out) {
  check_group_size(group_size);
  check_vector(packed, "packed", packed);
  check_vector(out, "out", packed);
  check_dtype(packed, at::kByte, "packed");
  const FloatKind kind = float_kind(out.scalar_type(), "out");
  const int64_t n = numel_from_packed(packed.numel(), group_size);
  TORCH_CHECK_VALUE(out.numel() == n, "zeroq: a packed buffer of " + num(packed.numel()) +
                                          " bytes decodes to " + num(n) +
                                          " elements, but out has " + num(out.numel()));
  const c10::cuda::CUDAGuard guard(packed.device());
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  check_launch(launch_dequantize_int8(reinterpret_cast<const int8_t*>(bytes), bytes + n, n,
                                      group_size, out.data_ptr(), kind,
                                      c10::cuda::getCurrentCUDAStream()));
}

void widen_checked_cuda(const at::Tensor& x, at::Tensor& out, at::Tensor& flag) {
  check_vector(x, "x", x);
  check_vector(out, "out", x);
  check_vector(flag, "flag", x);
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  check_dtype(out, at::kFloat, "out");
  check_dtype(flag, at::kFloat, "flag");
  TORCH_CHECK_VALUE(out.numel() == x.numel(), "zeroq: out has " + num(out.numel()) + " elements, x has " +
                                                  num(x.numel()) + "; they must be equal");
  TORCH_CHECK_VALUE(flag.numel() == 1, "zeroq: flag must hold one element, got " + num(flag.numel()));
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(launch_widen_checked(x.data_ptr(), kind, x.numel(), out.data_ptr<float>(),
                                    flag.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(zeroq, CUDA, m) {
  m.impl("quantize_pack_int8", &quantize_pack_int8_cuda);
  m.impl("unpack_dequantize_int8", &unpack_dequantize_int8_cuda);
  m.impl("widen_checked", &widen_checked_cuda);
}

}  // namespace zeroq
