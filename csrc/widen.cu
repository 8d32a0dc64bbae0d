// The gradient widening with its non-finite check in one pass (see widen.h): a unit's gradient in
// the working dtype becomes the fp32 shard the optimizer reads, and the same read tells whether it
// holds a NaN or an inf, where a second pass over the fp32 shard would read it again.
#include "widen.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace zeroq {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ __forceinline__ float load(const __half* x, int64_t i) { return __half2float(x[i]); }

// One value: widened, plus zero (-0 -> +0), and whether it is finite.
__device__ __forceinline__ float widen(float v, bool& bad) {
  const float w = v + 0.0f;
  bad |= !isfinite(w);
  return w;
}

// Four values per step, one 16-byte store: the launcher runs it where `out` is 16-byte aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads) widen_vec4(const T* __restrict__ x, float4* __restrict__ out,
                                                       int64_t quads, float* __restrict__ flag) {
  bool bad = false;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * q;
    float4 w;
    w.x = widen(load(x, i), bad);
    w.y = widen(load(x, i + 1), bad);
    w.z = widen(load(x, i + 2), bad);
    w.w = widen(load(x, i + 3), bad);
    out[q] = w;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1.0f;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) widen_scalar(const T* __restrict__ x, float* __restrict__ out,
                                                         int64_t n, float* __restrict__ flag) {
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = widen(load(x, i), bad);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1.0f;
}

int blocks_for(int64_t items) {
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 4096 ? wanted : 4096);  // grid-stride beyond
}

template <typename T>
cudaError_t launch(const T* x, int64_t n, float* out, float* flag, cudaStream_t stream) {
  const int64_t body = reinterpret_cast<uintptr_t>(out) % 16 == 0 ? n / 4 * 4 : 0;
  if (body > 0) {
    widen_vec4<T><<<blocks_for(body / 4), kThreads, 0, stream>>>(x, reinterpret_cast<float4*>(out), body / 4, flag);
  }
  if (n > body) {
    widen_scalar<T><<<blocks_for(n - body), kThreads, 0, stream>>>(x + body, out + body, n - body, flag);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_widen_checked(const void* x, FloatKind x_kind, int64_t n, float* out, float* flag,
                                 cudaStream_t stream) {
  if (n < 0 || (n > 0 && (x == nullptr || out == nullptr || flag == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  switch (x_kind) {
    case FloatKind::kFloat32: return launch(static_cast<const float*>(x), n, out, flag, stream);
    case FloatKind::kBFloat16: return launch(static_cast<const __nv_bfloat16*>(x), n, out, flag, stream);
    case FloatKind::kFloat16: return launch(static_cast<const __half*>(x), n, out, flag, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace zeroq
