// Skinny GEMM for the CPU decode step: y[M, N] = x[M, K] @ W[N, K]^T (* scale[N]) (+ b[N])
// for a few rows M (a batch-1 or small-batch decode step), W row-major in fp32, bf16, fp16
// or int8 (one fp32 scale per output row), x and y fp32, fp32 accumulation.
// Registered as torch.ops.triptych_gemv.gemv; built on first use by
// triptych/kernels/cpu_build.py (g++ -O3 -march=native).
//
// Why: at M = 1 the step only has to stream W from memory once. oneDNN's fp32 and bf16
// inner products spent ~1.4-1.7x the CPU time of this loop on the same bytes (the bench
// LM's 311 MB head and each layer's GEMV, docs/performance.md "Where the batch-1 step's
// time goes"). Each W row is read once, in order, into one AVX-512 accumulator (16 lanes;
// bf16 / fp16 widened to fp32 in registers); x (a few KB) stays in L1 for every row. Two
// or more rows per step from 4 interleaved rows of a row-major W read slower here, so
// rows go one at a time; for M > 1 each W row meets every row of x while it is in L1 (the
// libraries win from M = 2-4 on: cpu_linear.GEMV_MAX_ROWS). int8 on VNNI: below.
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TRIPTYCH_GEMV_AVX512 1
#endif

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
inline float to_f(int8_t x) { return static_cast<float>(x); }

#ifdef TRIPTYCH_GEMV_AVX512
// 16 weights from p as fp32 lanes (all 16, or the first `mask` lanes, others 0).
inline __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 bf16_lanes(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 ld(const c10::BFloat16* p) {
  return bf16_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 ld(const c10::BFloat16* p, __mmask16 m) {
  return bf16_lanes(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 ld(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 ld(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 ld(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 ld(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// dot(x, w) over K lanes, fp32 accumulation
template <typename T>
inline float dot(const float* x, const T* w, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(ld(w + k), _mm512_loadu_ps(x + k), acc);
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    acc = _mm512_fmadd_ps(ld(w + k, m), _mm512_maskz_loadu_ps(m, x + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#else
template <typename T>
inline float dot(const float* x, const T* w, int64_t K) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += x[k] * to_f(w[k]);
  return s;
}
#endif

template <typename T>
void gemv_kernel(const float* x, const T* w, const float* scale, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t grain) {
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* wn = w + n * K;
      const float s = scale ? scale[n] : 1.f;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        float v = dot(x + m * K, wn, K);
        if (scale) v *= s;
        y[m * N + n] = bias ? v + b : v;
      }
    }
  });
}

#if defined(TRIPTYCH_GEMV_AVX512) && defined(__AVX512VNNI__)
// int8 weights with VNNI: each x row quantized to 8 bits (symmetric, one scale per row,
// stored offset by 128 as u8), then vpdpbusd multiplies 64 u8 x s8 pairs into int32 sums
// per instruction (the fp32 widening above costs 3 instructions per 16 weights, which kept
// the int8 head at ~16 GB/s per core, below the memory's rate). The offset comes back out
// with the row's weight sum (``wsum``, taken once at load):
//   sum_k w_k * (q_k + 128) - 128 * sum_k w_k = sum_k w_k * q_k
// At K = 512 a row is 8 instructions, so the horizontal sums matter: 4 rows' accumulators
// are folded to 128 bits each and summed together by two rounds of hadd.
inline __m128i fold(__m512i v) {
  const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

void gemv_s8_kernel(const float* x, const int8_t* w, const float* scale, const int32_t* wsum,
                    const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                    int64_t grain) {
  const int64_t Kp = (K + 63) / 64 * 64;
  std::vector<uint8_t> xq(M * Kp, 128);  // the tail (masked off in w) stays at zero
  std::vector<float> xs(M);
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
    const float sx = amax > 0.f ? amax / 127.f : 1.f;
    xs[m] = sx;
    const float inv = 1.f / sx;
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::nearbyint(x[m * K + k] * inv);
      xq[m * Kp + k] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
    }
  }
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += 4) {
      const int64_t nr = end - n < 4 ? end - n : 4;
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* q = xq.data() + m * Kp;
        __m128i part[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(),
                           _mm_setzero_si128()};
        for (int64_t r = 0; r < nr; ++r) {  // one row at a time: one stream through W
          const int8_t* wn = w + (n + r) * K;
          __m512i acc = _mm512_setzero_si512();
          for (int64_t k = 0; k < K; k += 64) {
            const __mmask64 mask = K - k >= 64 ? ~0ULL : (1ULL << (K - k)) - 1;
            acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(q + k),
                                      _mm512_maskz_loadu_epi8(mask, wn + k));
          }
          part[r] = fold(acc);
        }
        alignas(16) int32_t dots[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(dots),
                        _mm_hadd_epi32(_mm_hadd_epi32(part[0], part[1]),
                                       _mm_hadd_epi32(part[2], part[3])));
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t o = n + r;
          const float v = static_cast<float>(dots[r] - 128 * wsum[o]) * xs[m] * scale[o];
          y[m * N + o] = bias ? v + bias[o] : v;
        }
      }
    }
  });
}
#define TRIPTYCH_GEMV_VNNI 1
#endif

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& wsum,
                int64_t grain) {
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
  grain = grain < 1 ? 1 : grain;
  switch (w.scalar_type()) {
    case at::kFloat:
      gemv_kernel(xp, w.data_ptr<float>(), sp, bp, yp, M, N, K, grain);
      break;
    case at::kBFloat16:
      gemv_kernel(xp, w.data_ptr<c10::BFloat16>(), sp, bp, yp, M, N, K, grain);
      break;
    case at::kHalf:
      gemv_kernel(xp, w.data_ptr<c10::Half>(), sp, bp, yp, M, N, K, grain);
      break;
    case at::kChar:
      TORCH_CHECK(sp != nullptr, "gemv: int8 weights need their per-row scale");
#ifdef TRIPTYCH_GEMV_VNNI
      TORCH_CHECK(wsum.has_value() && wsum->scalar_type() == at::kInt && wsum->is_contiguous()
                      && wsum->numel() == N, "gemv: int8 weights need their [N] int32 row sums");
      gemv_s8_kernel(xp, w.data_ptr<int8_t>(), sp, wsum->data_ptr<int32_t>(), bp, yp, M, N, K,
                     grain);
#else
      gemv_kernel(xp, w.data_ptr<int8_t>(), sp, bp, yp, M, N, K, grain);
#endif
      break;
    default:
      TORCH_CHECK(false, "gemv: weights must be float32, bfloat16, float16 or int8, got ",
                  w.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(triptych_gemv, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? scale, Tensor? bias, Tensor? wsum, int grain) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(triptych_gemv, CPU, m) { m.impl("gemv", &gemv); }
