// The batch-1 GEMV as a torch op: y[M, N] = x[M, K] @ W[N, K]^T (* scale[N]) (+ b[N]) for a
// few rows M, W row-major in fp32, bf16, fp16 or int8 (one fp32 scale per output row), x
// and y fp32. Registered as torch.ops.triptych_gemv.{gemv, variants}; built on first use
// by kernels/cpu/build.py with one copy of kernels.cpp per instruction-set variant; the
// call names the variant (kernels/cpu/isa.py, chosen by engine/device/platform.py).
//
// int8: each x row is quantized here to 8 bits (symmetric, [-127, 127], one scale per row)
// and the variant multiplies in exact int32 sums (kernels.cpp).
//
// Threads: output rows split over torch's intra-op threads (at::parallel_for); `grain`
// rows per thread at least, so a call whose grain covers N runs inline on the caller
// (the Python wrapper sizes it by bytes: a thread wake-up must pay for itself).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../variants.h"
#include "kernels.h"

namespace {

using triptych::GemvKernels;

const GemvKernels* const kTables[triptych::kVariants] = TRIPTYCH_TABLES(triptych::gemv);

std::vector<int64_t> variants() { return triptych::built_variants(); }

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& wsum,
                int64_t grain, int64_t variant) {
  const GemvKernels& kern = triptych::pick(kTables, variant, "gemv");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gemv: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "gemv: w must be a contiguous [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* sp = nullptr;
  const float* bp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == N, "gemv: scale must be [N] float32");
    sp = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N, "gemv: bias must be [N] float32");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  grain = std::max<int64_t>(grain, 1);
  switch (w.scalar_type()) {
    case at::kFloat: {
      const float* wp = w.data_ptr<float>();
      at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
        kern.f32(xp, wp, sp, bp, yp, M, N, K, b, e);
      });
      break;
    }
    case at::kBFloat16:
    case at::kHalf: {
      const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
      const auto fn = w.scalar_type() == at::kHalf ? kern.f16 : kern.bf16;
      at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
        fn(xp, wp, sp, bp, yp, M, N, K, b, e);
      });
      break;
    }
    case at::kChar: {
      TORCH_CHECK(sp != nullptr, "gemv: int8 weights need their per-row scale");
      TORCH_CHECK(wsum.has_value() && wsum->scalar_type() == at::kInt && wsum->is_contiguous()
                      && wsum->numel() == N, "gemv: int8 weights need their [N] int32 row sums");
      const int64_t Kp = (K + 63) / 64 * 64;
      std::vector<int8_t> xq(M * Kp, 0);  // zero past K: the variants may read whole vectors
      std::vector<float> xs(M);
      for (int64_t m = 0; m < M; ++m) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[m * K + k]));
        const float sx = amax > 0.f ? amax / 127.f : 1.f;
        xs[m] = sx;
        const float inv = 1.f / sx;
        for (int64_t k = 0; k < K; ++k)
          xq[m * Kp + k] = static_cast<int8_t>(std::nearbyint(xp[m * K + k] * inv));
      }
      const int8_t* wp = w.data_ptr<int8_t>();
      const int32_t* ws = wsum->data_ptr<int32_t>();
      at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
        kern.s8(xq.data(), xs.data(), Kp, wp, sp, ws, bp, yp, M, N, K, b, e);
      });
      break;
    }
    default:
      TORCH_CHECK(false, "gemv: weights must be float32, bfloat16, float16 or int8, got ",
                  w.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(triptych_gemv, m) {
  m.def("variants() -> int[]", &variants);
  m.def("gemv(Tensor x, Tensor w, Tensor? scale, Tensor? bias, Tensor? wsum, int grain, "
        "int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_gemv, CPU, m) { m.impl("gemv", &gemv); }
