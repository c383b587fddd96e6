// The GEMV's entry points, one table per instruction-set variant (kernels.cpp, compiled
// once per variant; op.cpp calls the table the platform chose).
#pragma once

#include <cstdint>

namespace triptych {

// Output columns [n0, n1) of y[M, N] = x[M, K] @ w[N, K]^T (* scale[n]) (+ bias[n]); y's
// rows are N apart. scale / bias may be null. 16-bit weights are raw bits (bf16 / fp16).
template <typename W>
using GemvFn = void (*)(const float* x, const W* w, const float* scale, const float* bias,
                        float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1);

struct GemvKernels {
  GemvFn<float> f32;
  GemvFn<uint16_t> bf16;
  GemvFn<uint16_t> f16;
  // int8 weights against x quantized per row: xq [M, Kp] int8 in [-127, 127] (zero past K,
  // Kp = K rounded up to 64), xs [M] its scales; y = (sum_k w q) * xs[m] * scale[n] (+ bias)
  // in exact int32 sums, so every variant gives the same bits. wsum [N]: the rows' sums
  // (the VNNI copy's correction for its u8 operand).
  void (*s8)(const int8_t* xq, const float* xs, int64_t Kp, const int8_t* w,
             const float* scale, const int32_t* wsum, const float* bias, float* y, int64_t M,
             int64_t N, int64_t K, int64_t n0, int64_t n1);
};

extern const GemvKernels gemv_v0, gemv_v1, gemv_v2, gemv_v3;

}  // namespace triptych
