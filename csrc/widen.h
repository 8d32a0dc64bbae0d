// Launcher API for the gradient-widening kernel (csrc/widen.cu), free of torch headers like
// quant_int8.h (it reuses its FloatKind).
//
// out[i] = float32(x[i]) + 0.0f for i in [0, n), and *flag = 1.0f when any out[i] is NaN or +-inf
// (left as it is otherwise). The +0.0f is the one arithmetic step: every value passes unchanged
// except -0, which becomes +0, exactly as torch.add(x, 0.0, out=out) computes it; the widening of
// a float16 or bfloat16 value to float32 is exact. The specification is ops/reference.py's
// widen_checked.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "quant_int8.h"

namespace zeroq {

// Enqueues on `stream`; returns the launch error. n == 0 launches nothing. `x` and `out` may have any
// alignment (four values a store where `out` is 16-byte aligned).
cudaError_t launch_widen_checked(const void* x, FloatKind x_kind, int64_t n, float* out, float* flag,
                                 cudaStream_t stream);

}  // namespace zeroq
