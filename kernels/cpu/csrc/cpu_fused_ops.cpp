// Small fused ops of the CPU decoder layer: one op (one pass, no temporaries) where the
// torch reference issues several. Registered as torch.ops.triptych_fused.*; built on first
// use by triptych/kernels/cpu_build.py. Python side and fallbacks: kernels/cpu_fused_ops.py.
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
// Rounding: mrope computes each product and the sum as separate fp32 roundings (no FMA
// contraction), so it equals the torch reference (and HF) bit for bit; add_rms_norm sums
// the squares in another order than torch (float rounding of the mean only); silu_and_mul
// computes x / (1 + exp(-x)) and then the product as torch does, with its own exp (within
// ~1 ulp of torch's, so results differ by a few ulp at most: tests/test_cpu_fused_ops.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TRIPTYCH_FUSED_AVX512 1
#endif

namespace {

// Rows per thread: one thread unless the op has >= 64K elements to write (waking an idle
// OpenMP thread costs ~50-100 us on a busy box, more than a small op's whole run).
int64_t row_grain(int64_t T, int64_t per_row) { return T * per_row < (1 << 16) ? T : 1; }

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
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
    for (int64_t t = b; t < end; ++t) {
      const float* src = xp + t * xs;
      if (sp) {
        float* s = sp + t * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) s[c] = src[c] + rp[t * rs + c];
        src = s;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += src[c] * src[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + e);
      float* out = yp + t * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = wp[c] * (src[c] * inv);
    }
  });
  return {y, sum};
}

// separate roundings of both products and the sum: torch_ref's (and HF's) fp32 result
__attribute__((optimize("fp-contract=off"))) void rope_rows(
    const float* x, int64_t ts, int64_t hs, float* out, const float* cos, const float* sin,
    int64_t T, int64_t H, int64_t D) {
  const int64_t d2 = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* xi = x + t * ts + h * hs;
      float* o = out + (t * H + h) * D;
      for (int64_t i = 0; i < d2; ++i) {
        const float a = xi[i] * c[i];
        const float b = xi[i + d2] * s[i];
        o[i] = a + b;
      }
      for (int64_t i = d2; i < D; ++i) {
        const float a = xi[i] * c[i];
        const float b = xi[i - d2] * s[i];
        o[i] = a + b;
      }
    }
  }
}

at::Tensor rope_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "mrope: q / k must be [T, H, D] float32 with unit-stride heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  at::Tensor out = at::empty({T, H, D}, x.options());
  rope_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), out.data_ptr<float>(),
            cos.data_ptr<float>(), sin.data_ptr<float>(), T, H, D);
  return out;
}

std::tuple<at::Tensor, at::Tensor> mrope(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() &&
                  q.dim() == 3 && cos.numel() == q.size(0) * q.size(2) && q.size(2) % 2 == 0,
              "mrope: cos / sin must be contiguous [T, 1, D] float32 rows of q's T and D");
  TORCH_CHECK(k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "mrope: k must be [T, Hkv, D] with q's T and D");
  return {rope_one(q, cos, sin), rope_one(k, cos, sin)};
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

#ifdef TRIPTYCH_FUSED_AVX512
// e^x of 16 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in a short high part, so
// n * ln2_hi is exact, and the rest), e^r by its Taylor series to r^7 (truncation below
// 2^-25 relative), then times 2^n with scalef (overflow to inf, underflow through the
// subnormals to 0). Clamping keeps n finite for +-inf; NaN passes through (max / min
// return their second operand when one is NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-110.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u, rounded as torch's two ops: s = g / (1 + e^-g), then s * u
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}
#endif

void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t c = 0;
#ifdef TRIPTYCH_FUSED_AVX512
  for (; c + 16 <= n; c += 16)
    _mm512_storeu_ps(out + c, silu_mul16(_mm512_loadu_ps(g + c), _mm512_loadu_ps(u + c)));
  if (c < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - c)) - 1);
    _mm512_mask_storeu_ps(out + c, m, silu_mul16(_mm512_maskz_loadu_ps(m, g + c),
                                                 _mm512_maskz_loadu_ps(m, u + c)));
  }
#else
  for (; c < n; ++c) {
    const float s = g[c] / (1.f + std::exp(-g[c]));
    out[c] = s * u[c];
  }
#endif
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, int64_t inter) {
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
    for (int64_t t = b; t < end; ++t)
      silu_mul_row(gp + t * rs, gp + t * rs + inter, op + t * inter, inter);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_fused, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("mrope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> ()");
  m.def("silu_and_mul(Tensor gate_up, int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_fused, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("mrope", &mrope);
  m.impl("cache_write", &cache_write);
  m.impl("silu_and_mul", &silu_and_mul);
}
