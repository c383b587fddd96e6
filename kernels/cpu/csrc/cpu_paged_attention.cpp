// Paged decode attention for the CPU: one query token per sequence, K/V read in place
// from their cache blocks through the block table (no gathered copy), online softmax over
// blocks, fp32 accumulation. Registered as torch.ops.triptych_cpu.paged_decode_attention;
// built on first use by triptych/kernels/cpu_build.py (g++ -O3 -march=native).
//
//   q:            [B, H, D]                     fp32 / bf16 / fp16, rows contiguous
//   k/v_cache:    [num_blocks, bs, Hkv, D]      same dtype as q, contiguous
//   block_tables: [B, max_blocks] int32;  seq_lens: [B] int32 (context incl. the query)
//   out:          [B, H, D]                     dtype of q
//
// Work item = (sequence b, KV head h): its G = H / Hkv query heads share every K/V row
// read, so each cached row is loaded once per step. Items run on torch's intra-op
// threads (at::parallel_for); `grain` items per thread at least (the Python wrapper sizes
// it so a thread wake-up pays for itself).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// dot(a, k) over D lanes; `omp simd reduction` lets the compiler vectorise the sum
// without -ffast-math (it may reorder it: fp32 rounding differs from SDPA's by ~1e-7).
template <typename T>
inline float dot(const float* a, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * to_f(k[i]);
  return s;
}

// e^x for x <= 0 in a form the compiler vectorises (std::exp stays a scalar call):
// e^x = 2^k * 2^f with k = round(x / ln 2), |f| <= 1/2, 2^f by its degree-7 Taylor series
// (relative error < 1e-8, under fp32's epsilon). x below -87 (and -inf) gives ~1e-38, not 0:
// weights that small vanish in every sum they join.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float k = std::floor(t + 0.5f);
  const float f = (t - k) * 0.693147180559945309f;  // f in [-ln2/2, ln2/2]
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const auto bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * to_f(v[i]);
}

#if defined(__AVX512F__)
// The AVX-512 path for head sizes that are a multiple of 16 (64, 128, ...): each K row is
// loaded once per block and its chunks feed every query head of the group; each score ends
// in one horizontal sum of 4 partial vectors (independent FMA chains); the P @ V product
// keeps 4 output chunks per head in registers across the block's tokens. bf16 / fp16 rows
// are widened to fp32 in registers.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// s[g * bs + t] = qf[g] . k_t for the block's n tokens; qf is [G, D] fp32 (pre-scaled).
template <typename T>
inline void block_scores(const float* qf, const T* kb, int64_t row, int64_t n, int64_t G,
                         int64_t D, int64_t bs, float* s) {
  for (int64_t t = 0; t < n; ++t) {
    const T* kt = kb + t * row;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 64 <= D; c += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c), load16(kt + c), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c + 16), load16(kt + c + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c + 32), load16(kt + c + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c + 48), load16(kt + c + 48), a3);
      }
      for (; c < D; c += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c), load16(kt + c), a0);
      s[g * bs + t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1),
                                                         _mm512_add_ps(a2, a3)));
    }
  }
}

// acc[g] += sum_t p[g * bs + t] * v_t over the block's n tokens, 64 lanes of D at a time.
template <typename T>
inline void block_pv(const float* p, const T* vb, int64_t row, int64_t n, int64_t G,
                     int64_t D, int64_t bs, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * bs;
    float* ag = acc + g * D;
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) {
      __m512 r0 = _mm512_loadu_ps(ag + c), r1 = _mm512_loadu_ps(ag + c + 16);
      __m512 r2 = _mm512_loadu_ps(ag + c + 32), r3 = _mm512_loadu_ps(ag + c + 48);
      for (int64_t t = 0; t < n; ++t) {
        const T* vt = vb + t * row + c;
        const __m512 w = _mm512_set1_ps(pg[t]);
        r0 = _mm512_fmadd_ps(w, load16(vt), r0);
        r1 = _mm512_fmadd_ps(w, load16(vt + 16), r1);
        r2 = _mm512_fmadd_ps(w, load16(vt + 32), r2);
        r3 = _mm512_fmadd_ps(w, load16(vt + 48), r3);
      }
      _mm512_storeu_ps(ag + c, r0);
      _mm512_storeu_ps(ag + c + 16, r1);
      _mm512_storeu_ps(ag + c + 32, r2);
      _mm512_storeu_ps(ag + c + 48, r3);
    }
    for (; c < D; c += 16) {
      __m512 r = _mm512_loadu_ps(ag + c);
      for (int64_t t = 0; t < n; ++t)
        r = _mm512_fmadd_ps(_mm512_set1_ps(pg[t]), load16(vb + t * row + c), r);
      _mm512_storeu_ps(ag + c, r);
    }
  }
}
constexpr bool kVectorPath = true;
#else
template <typename T>
inline void block_scores(const float*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,
                         float*) {}
template <typename T>
inline void block_pv(const float*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,
                     float*) {}
constexpr bool kVectorPath = false;
#endif

template <typename T>
void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* tables,
                   const int32_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv,
                   int64_t D, int64_t bs, int64_t max_blocks, int64_t num_blocks, float scale,
                   int64_t grain) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements between consecutive tokens of one block
  const bool vec = kVectorPath && D % 16 == 0;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    // per-thread scratch: scaled queries, accumulators, running max / sum, block scores
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), s(G * bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lens[b];
      TORCH_CHECK(len <= max_blocks * bs, "seq_lens[", b, "] = ", len, " exceeds its block table");
      const T* qb = q + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(qb[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = tables + b * max_blocks;
      for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
        const int64_t n = std::min(bs, len - start);
        TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block id ", table[j], " out of range");
        const int64_t base = (static_cast<int64_t>(table[j]) * bs * Hkv + h) * D;
        const T* kb = kc + base;
        const T* vb = vc + base;
        if (vec)
          block_scores(qf.data(), kb, row, n, G, D, bs, s.data());
        else
          for (int64_t t = 0; t < n; ++t)
            for (int64_t g = 0; g < G; ++g) s[g * bs + t] = dot(&qf[g * D], kb + t * row, D);
        for (int64_t g = 0; g < G; ++g) {
          float* sg = &s[g * bs];
          float mx = m[g];
          for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
          const float corr = exp_neg(m[g] - mx);  // ~0 on the first block (m = -inf)
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = exp_neg(sg[t] - mx);
            sum += sg[t];
          }
          l[g] = l[g] * corr + sum;
          m[g] = mx;
          float* ag = &acc[g * D];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) ag[i] *= corr;
        }
        if (vec)
          block_pv(s.data(), vb, row, n, G, D, bs, acc.data());
        else
          for (int64_t t = 0; t < n; ++t)
            for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], s[g * bs + t], vb + t * row, D);
      }
      T* ob = out + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // len 0: zeros, not NaN
        for (int64_t i = 0; i < D; ++i) ob[g * D + i] = static_cast<T>(acc[g * D + i] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t grain) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, H, D], k_cache [N, bs, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention needs contiguous tensors");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the KV cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes() && H % Hkv == 0,
              "shape mismatch between q and the KV cache");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "one table row per sequence");
  at::Tensor out = at::empty_like(q);
  if (B == 0) return out;
  const int64_t mb = block_tables.size(1), nb = k_cache.size(0);
  const float sc = static_cast<float>(scale);
  const int64_t gr = std::max<int64_t>(grain, 1);
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_kernel(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                    tables, lens, out.data_ptr<float>(), B, H, Hkv, D, bs, mb, nb, sc, gr);
      break;
    case at::kBFloat16:
      decode_kernel(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
                    v_cache.data_ptr<c10::BFloat16>(), tables, lens,
                    out.data_ptr<c10::BFloat16>(), B, H, Hkv, D, bs, mb, nb, sc, gr);
      break;
    case at::kHalf:
      decode_kernel(q.data_ptr<c10::Half>(), k_cache.data_ptr<c10::Half>(),
                    v_cache.data_ptr<c10::Half>(), tables, lens, out.data_ptr<c10::Half>(),
                    B, H, Hkv, D, bs, mb, nb, sc, gr);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: fp32, bf16 or fp16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int grain) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
