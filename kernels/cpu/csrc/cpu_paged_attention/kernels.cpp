// Paged decode attention's kernels, compiled once per instruction-set variant (../simd.h):
// one query token per sequence, K/V read in place from their cache blocks through the
// block table (no gathered copy), online softmax over blocks, fp32 accumulation. The torch
// op around them (checks, threads, scratch) is op.cpp.
//
// Work item = (sequence b, KV head h): its G = H / Hkv query heads share every K/V row
// read, so each cached row is loaded once per step.
//
//   avx512   head sizes that are a multiple of 16 (64, 128, ...): each K row is loaded once
//            per block and its chunks feed every query head of the group; each score ends in
//            one horizontal sum of 4 partial vectors (independent FMA chains); P @ V keeps 4
//            output chunks per head in registers across the block's tokens
//   avx2     the same in 8-lane vectors for head sizes that are a multiple of 8
//   generic  (and other head sizes) `omp simd` loops the compiler vectorises
// bf16 / fp16 rows are widened to fp32 in registers.
#include "../simd.h"
#include "kernels.h"

namespace {

inline float fmax_(float a, float b) { return a < b ? b : a; }

struct F32 {
  using T = float;
  static float get(float v) { return v; }
  static float put(float v) { return v; }
};
struct Bf16 {
  using T = uint16_t;
  static float get(uint16_t v) { return bf16_to_f(v); }
  static uint16_t put(float v) { return f_to_bf16(v); }
};
struct F16 {
  using T = uint16_t;
  static float get(uint16_t v) { return half_to_f(v); }
  static uint16_t put(float v) { return f_to_half(v); }
};

// dot(a, k) over D lanes; `omp simd reduction` lets the compiler vectorise the sum
// without -ffast-math (it may reorder it: fp32 rounding differs from SDPA's by ~1e-7).
template <typename Fmt>
inline float dot(const float* a, const typename Fmt::T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * Fmt::get(k[i]);
  return s;
}

template <typename Fmt>
inline void axpy(float* acc, float p, const typename Fmt::T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * Fmt::get(v[i]);
}

// e^x for x <= 0 in a form the compiler vectorises (a libm call stays scalar):
// e^x = 2^k * 2^f with k = round(x / ln 2), |f| <= 1/2, 2^f by its degree-7 Taylor series
// (relative error < 1e-8, under fp32's epsilon). x below -87 (and -inf) gives ~1e-38, not 0:
// weights that small vanish in every sum they join.
inline float exp_neg(float x) {
  x = fmax_(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float k = __builtin_floorf(t + 0.5f);
  const float f = (t - k) * 0.693147180559945309f;  // f in [-ln2/2, ln2/2]
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  return p * bits_to_f(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t LANES = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vset(float v) { return _mm512_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t LANES = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset(float v) { return _mm256_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
constexpr int64_t LANES = 0;  // no vector path: the portable loops
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
constexpr int64_t C4 = 4 * LANES;  // one step of the 4-chain loops
template <typename Fmt>
inline vec vrow(const typename Fmt::T* p);
template <>
inline vec vrow<F32>(const float* p) { return load(p); }
template <>
inline vec vrow<Bf16>(const uint16_t* p) { return load_bf16(p); }
template <>
inline vec vrow<F16>(const uint16_t* p) { return load_f16(p); }

// s[g * bs + t] = qf[g] . k_t for the block's n tokens; qf is [G, D] fp32 (pre-scaled).
template <typename Fmt>
inline void block_scores(const float* qf, const typename Fmt::T* kb, int64_t row, int64_t n,
                         int64_t G, int64_t D, int64_t bs, float* s) {
  for (int64_t t = 0; t < n; ++t) {
    const typename Fmt::T* kt = kb + t * row;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      int64_t c = 0;
      for (; c + C4 <= D; c += C4) {
        a0 = vfma(vload(qg + c), vrow<Fmt>(kt + c), a0);
        a1 = vfma(vload(qg + c + LANES), vrow<Fmt>(kt + c + LANES), a1);
        a2 = vfma(vload(qg + c + 2 * LANES), vrow<Fmt>(kt + c + 2 * LANES), a2);
        a3 = vfma(vload(qg + c + 3 * LANES), vrow<Fmt>(kt + c + 3 * LANES), a3);
      }
      for (; c < D; c += LANES) a0 = vfma(vload(qg + c), vrow<Fmt>(kt + c), a0);
      s[g * bs + t] = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
    }
  }
}

// acc[g] += sum_t p[g * bs + t] * v_t over the block's n tokens, 4 vectors of D at a time.
template <typename Fmt>
inline void block_pv(const float* p, const typename Fmt::T* vb, int64_t row, int64_t n,
                     int64_t G, int64_t D, int64_t bs, float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * bs;
    float* ag = acc + g * D;
    int64_t c = 0;
    for (; c + C4 <= D; c += C4) {
      vec r0 = vload(ag + c), r1 = vload(ag + c + LANES);
      vec r2 = vload(ag + c + 2 * LANES), r3 = vload(ag + c + 3 * LANES);
      for (int64_t t = 0; t < n; ++t) {
        const typename Fmt::T* vt = vb + t * row + c;
        const vec w = vset(pg[t]);
        r0 = vfma(w, vrow<Fmt>(vt), r0);
        r1 = vfma(w, vrow<Fmt>(vt + LANES), r1);
        r2 = vfma(w, vrow<Fmt>(vt + 2 * LANES), r2);
        r3 = vfma(w, vrow<Fmt>(vt + 3 * LANES), r3);
      }
      vstore(ag + c, r0);
      vstore(ag + c + LANES, r1);
      vstore(ag + c + 2 * LANES, r2);
      vstore(ag + c + 3 * LANES, r3);
    }
    for (; c < D; c += LANES) {
      vec r = vload(ag + c);
      for (int64_t t = 0; t < n; ++t) r = vfma(vset(pg[t]), vrow<Fmt>(vb + t * row + c), r);
      vstore(ag + c, r);
    }
  }
}
#else
template <typename Fmt>
inline void block_scores(const float*, const typename Fmt::T*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float*) {}
template <typename Fmt>
inline void block_pv(const float*, const typename Fmt::T*, int64_t, int64_t, int64_t,
                     int64_t, int64_t, float*) {}
#endif

template <typename Fmt>
void decode(const typename Fmt::T* q, const typename Fmt::T* kc, const typename Fmt::T* vc,
            const int32_t* tables, const int32_t* lens, typename Fmt::T* out, int64_t H,
            int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, float scale, int64_t i0,
            int64_t i1, float* scratch) {
  using T = typename Fmt::T;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements between consecutive tokens of one block
  const bool vec_path = LANES > 0 && D % (LANES > 0 ? LANES : 1) == 0;
  float* qf = scratch;  // scaled queries, accumulators, running max / sum, block scores
  float* acc = qf + G * D;
  float* m = acc + G * D;
  float* l = m + G;
  float* s = l + G;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t b = item / Hkv, h = item % Hkv;
    const int64_t len = lens[b];
    const T* qb = q + (b * H + h * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qf[i] = Fmt::get(qb[i]) * scale;
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      m[g] = -__builtin_inff();
      l[g] = 0.f;
    }
    const int32_t* table = tables + b * max_blocks;
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
      const int64_t n = len - start < bs ? len - start : bs;
      const int64_t base = (static_cast<int64_t>(table[j]) * bs * Hkv + h) * D;
      const T* kb = kc + base;
      const T* vb = vc + base;
      if (vec_path)
        block_scores<Fmt>(qf, kb, row, n, G, D, bs, s);
      else
        for (int64_t t = 0; t < n; ++t)
          for (int64_t g = 0; g < G; ++g) s[g * bs + t] = dot<Fmt>(&qf[g * D], kb + t * row, D);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &s[g * bs];
        float mx = m[g];
        for (int64_t t = 0; t < n; ++t) mx = fmax_(mx, sg[t]);
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
      if (vec_path)
        block_pv<Fmt>(s, vb, row, n, G, D, bs, acc);
      else
        for (int64_t t = 0; t < n; ++t)
          for (int64_t g = 0; g < G; ++g) axpy<Fmt>(&acc[g * D], s[g * bs + t], vb + t * row, D);
    }
    T* ob = out + (b * H + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // len 0: zeros, not NaN
      for (int64_t i = 0; i < D; ++i) ob[g * D + i] = Fmt::put(acc[g * D + i] * inv);
    }
  }
}

}  // namespace

namespace triptych {
extern const AttentionKernels TRIPTYCH_TABLE(attention) = {decode<F32>, decode<Bf16>, decode<F16>};
}  // namespace triptych
