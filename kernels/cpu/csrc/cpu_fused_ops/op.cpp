// Small fused ops of the CPU decoder layer: one op (one pass, no temporaries) where the
// torch reference issues several. Registered as torch.ops.triptych_fused.*; built on first
// use by kernels/cpu/build.py with one copy of kernels.cpp per instruction-set variant; the
// calls name the variant (kernels/cpu/isa.py, chosen by engine/device/platform.py). Python side and
// fallbacks: kernels/cpu/fused_ops.py.
//
//   add_rms_norm(x [T, C], residual? [T, C], weight [C], eps) -> (y, x + residual)
//       fp32; residual absent: (y, x). y = (x + r) * rsqrt(mean((x + r)^2) + eps) * weight.
//   mrope(q [T, H, D], k [T, Hkv, D], cos [T, 1, D], sin [T, 1, D]) -> (q', k')
//       x * cos + roll(x, D/2) * sin per head (the plan rows of torch_ref.mrope_plan), fp32,
//       q / k may be strided views of the fused qkv output; outputs contiguous.
//   cache_write(key [T, Hkv, D], value, k_cache [N, bs, Hkv, D], v_cache, slots [T] int64)
//       rows with slot >= 0 copied into the caches (slot -1: padding, skipped), in place.
//   silu_and_mul(gate_up [T, 2I], I) -> [T, I]
//       SwiGLU's activation silu(gate) * up, gate = columns [0, I), up = [I, 2I) (Qwen2MLP's
//       split of its fused projection), fp32, rows may be strided (unit-stride columns).
//
// Why: at batch 1 the layer's small ops are ~20 torch calls per layer (add + norm twice,
// roll / mul / mul / add for q and k, two index_copy_) of a few KB each, where the call
// overhead is the cost (docs/performance.md, "Batch 1: the layers' small ops"). At batch 32
// the MLP's silu and mul were two passes over [32, 2 x 1376] fp32 per layer plus a
// temporary ("Batch 32 and the layers' small ops"): one pass here.
//
// Rounding: kernels.cpp (mrope: torch's bits in every variant; the norm and silu_and_mul
// within a few ulp: tests/test_cpu_fused_ops.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "../variants.h"
#include "kernels.h"

namespace {

using triptych::FusedKernels;

const FusedKernels* const kTables[triptych::kVariants] = TRIPTYCH_TABLES(triptych::fused);

std::vector<int64_t> variants() { return triptych::built_variants(); }

// Rows per thread: one thread unless the op has >= 64K elements to write (waking an idle
// OpenMP thread costs ~50-100 us on a busy box, more than a small op's whole run).
int64_t row_grain(int64_t T, int64_t per_row) { return T * per_row < (1 << 16) ? T : 1; }

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps,
                                                int64_t variant) {
  const FusedKernels& kern = triptych::pick(kTables, variant, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "add_rms_norm: x must be [T, C] float32 with unit-stride rows");
  const int64_t T = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == C,
              "add_rms_norm: weight must be [C] float32");
  const float* rp = nullptr;
  int64_t rs = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat &&
                    residual->stride(1) == 1, "add_rms_norm: residual must match x");
    rp = residual->data_ptr<float>();
    rs = residual->stride(0);
  }
  at::Tensor y = at::empty({T, C}, x.options());
  at::Tensor sum = rp ? at::empty({T, C}, x.options()) : x;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = rp ? sum.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, row_grain(T, C), [&](int64_t b, int64_t end) {
    kern.rms_rows(xp, xs, rp, rs, wp, yp, sp, C, e, b, end);
  });
  return {y, sum};
}

at::Tensor rope_one(const FusedKernels& kern, const at::Tensor& x, const at::Tensor& cos,
                    const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "mrope: q / k must be [T, H, D] float32 with unit-stride heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  at::Tensor out = at::empty({T, H, D}, x.options());
  kern.rope(x.data_ptr<float>(), x.stride(0), x.stride(1), out.data_ptr<float>(),
            cos.data_ptr<float>(), sin.data_ptr<float>(), T, H, D);
  return out;
}

std::tuple<at::Tensor, at::Tensor> mrope(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& cos, const at::Tensor& sin,
                                         int64_t variant) {
  const FusedKernels& kern = triptych::pick(kTables, variant, "mrope");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() &&
                  q.dim() == 3 && cos.numel() == q.size(0) * q.size(2) && q.size(2) % 2 == 0,
              "mrope: cos / sin must be contiguous [T, 1, D] float32 rows of q's T and D");
  TORCH_CHECK(k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "mrope: k must be [T, Hkv, D] with q's T and D");
  return {rope_one(kern, q, cos, sin), rope_one(kern, k, cos, sin)};
}

void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "cache_write: caches [N, bs, Hkv, D]");
  const int64_t N = k_cache.size(0) * k_cache.size(1), row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) * key.size(2) == row,
              "cache_write: key / value must be [T, Hkv, D] of the cache's Hkv and D");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type() &&
                  key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "cache_write: key / value in the cache's dtype, heads contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == key.size(0), "cache_write: slots must be [T] int64");
  const int64_t T = key.size(0), es = key.element_size(), bytes = row * es;
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sp[t];
    if (s < 0) continue;
    TORCH_CHECK(s < N, "cache_write: slot ", s, " beyond the cache's ", N, " slots");
    std::memcpy(kc + s * bytes, kp + t * key.stride(0) * es, bytes);
    std::memcpy(vc + s * bytes, vp + t * value.stride(0) * es, bytes);
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, int64_t inter, int64_t variant) {
  const FusedKernels& kern = triptych::pick(kTables, variant, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.stride(1) == 1, "silu_and_mul: gate_up must be [T, 2 * inter] "
                  "float32 with unit-stride rows");
  TORCH_CHECK(inter > 0 && gate_up.size(1) == 2 * inter, "silu_and_mul: gate_up has ",
              gate_up.size(1), " columns, not 2 * inter = ", 2 * inter);
  const int64_t T = gate_up.size(0), rs = gate_up.stride(0);
  at::Tensor out = at::empty({T, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(T, inter), [&](int64_t b, int64_t end) {
    kern.silu_mul_rows(gp, rs, inter, op, b, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_fused, m) {
  m.def("variants() -> int[]", &variants);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, int variant) -> "
        "(Tensor, Tensor)");
  m.def("mrope(Tensor q, Tensor k, Tensor cos, Tensor sin, int variant) -> (Tensor, Tensor)");
  m.def("cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> ()");
  m.def("silu_and_mul(Tensor gate_up, int inter, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_fused, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("mrope", &mrope);
  m.impl("cache_write", &cache_write);
  m.impl("silu_and_mul", &silu_and_mul);
}
