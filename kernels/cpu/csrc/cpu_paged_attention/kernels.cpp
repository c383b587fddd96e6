// Paged decode attention's kernels, compiled once per instruction-set variant (../simd.h):
// one query token per sequence, K/V read in place from their cache blocks through the
// block table (no gathered copy), online softmax over blocks, fp32 accumulation. The torch
// op around them (checks, threads, scratch) is op.cpp.
//
// Work item = (sequence b, KV head h): its G = H / Hkv query heads share every K/V row
// read, so each cached row is loaded once per step.
//
//   avx512   head sizes that are a multiple of 16 from 64 (64, 80, 128, ...): each K row is
//            loaded once per block and its chunks feed every query head of the group; each
//            score ends in one horizontal sum of 4 partial vectors (independent FMA chains);
//            P @ V keeps 4 output chunks per head in registers across the block's tokens;
//            smaller head sizes that are a multiple of 8 take the 8-lane path below
//   avx2     the same in 8-lane vectors for head sizes that are a multiple of 8
//   generic  (and other head sizes) `omp simd` loops the compiler vectorises
// bf16 / fp16 rows are widened to fp32 in registers.
#include "../exp_neg.h"
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

// The vector paths, one policy struct per register width. An AVX-512 copy has both: the
// 16-lane one for head sizes that fill its 4-chain loop (a multiple of 16, at least 64),
// the 8-lane one below that (D = 32: four 8-lane chains and one 256-bit horizontal sum per
// score instead of one 16-lane chain and a 512-bit sum; ~25% faster per call measured on
// Zen 4, batch 16, ~725 tokens of context).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TRIPTYCH_V256 1
struct V256 {
  static constexpr int64_t LANES = 8;
  using vec = __m256;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec set(float v) { return _mm256_set1_ps(v); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static float sum(vec v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static vec row(const float* p) { return _mm256_loadu_ps(p); }
  static vec row_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static vec row_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TRIPTYCH_V512 1
struct V512 {
  static constexpr int64_t LANES = 16;
  using vec = __m512;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec set(float v) { return _mm512_set1_ps(v); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static float sum(vec v) { return _mm512_reduce_add_ps(v); }
  static vec row(const float* p) { return _mm512_loadu_ps(p); }
  static vec row_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static vec row_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
#endif

// A cached row's chunk widened to fp32 lanes, per storage format.
template <typename V, typename Fmt>
struct Row;
template <typename V>
struct Row<V, F32> {
  static typename V::vec at(const float* p) { return V::row(p); }
};
template <typename V>
struct Row<V, Bf16> {
  static typename V::vec at(const uint16_t* p) { return V::row_bf16(p); }
};
template <typename V>
struct Row<V, F16> {
  static typename V::vec at(const uint16_t* p) { return V::row_f16(p); }
};

// s[g * bs + t] = qf[g] . k_t for the block's n tokens; qf is [G, D] fp32 (pre-scaled).
template <typename V, typename Fmt>
inline void block_scores(const float* qf, const typename Fmt::T* kb, int64_t row, int64_t n,
                         int64_t G, int64_t D, int64_t bs, float* s) {
  constexpr int64_t L = V::LANES, C4 = 4 * L;  // one step of the 4-chain loop
  using R = Row<V, Fmt>;
  for (int64_t t = 0; t < n; ++t) {
    const typename Fmt::T* kt = kb + t * row;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      typename V::vec a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
      int64_t c = 0;
      for (; c + C4 <= D; c += C4) {
        a0 = V::fma(V::load(qg + c), R::at(kt + c), a0);
        a1 = V::fma(V::load(qg + c + L), R::at(kt + c + L), a1);
        a2 = V::fma(V::load(qg + c + 2 * L), R::at(kt + c + 2 * L), a2);
        a3 = V::fma(V::load(qg + c + 3 * L), R::at(kt + c + 3 * L), a3);
      }
      for (; c < D; c += L) a0 = V::fma(V::load(qg + c), R::at(kt + c), a0);
      s[g * bs + t] = V::sum(V::add(V::add(a0, a1), V::add(a2, a3)));
    }
  }
}

// acc[g] += sum_t p[g * bs + t] * v_t over the block's n tokens, 4 vectors of D at a time.
template <typename V, typename Fmt>
inline void block_pv(const float* p, const typename Fmt::T* vb, int64_t row, int64_t n,
                     int64_t G, int64_t D, int64_t bs, float* acc) {
  constexpr int64_t L = V::LANES, C4 = 4 * L;
  using R = Row<V, Fmt>;
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * bs;
    float* ag = acc + g * D;
    int64_t c = 0;
    for (; c + C4 <= D; c += C4) {
      typename V::vec r0 = V::load(ag + c), r1 = V::load(ag + c + L);
      typename V::vec r2 = V::load(ag + c + 2 * L), r3 = V::load(ag + c + 3 * L);
      for (int64_t t = 0; t < n; ++t) {
        const typename Fmt::T* vt = vb + t * row + c;
        const typename V::vec w = V::set(pg[t]);
        r0 = V::fma(w, R::at(vt), r0);
        r1 = V::fma(w, R::at(vt + L), r1);
        r2 = V::fma(w, R::at(vt + 2 * L), r2);
        r3 = V::fma(w, R::at(vt + 3 * L), r3);
      }
      V::store(ag + c, r0);
      V::store(ag + c + L, r1);
      V::store(ag + c + 2 * L, r2);
      V::store(ag + c + 3 * L, r3);
    }
    for (; c < D; c += L) {
      typename V::vec r = V::load(ag + c);
      for (int64_t t = 0; t < n; ++t) r = V::fma(V::set(pg[t]), R::at(vb + t * row + c), r);
      V::store(ag + c, r);
    }
  }
}

// Which path a head size takes in this copy.
enum class Path { portable, v256, v512 };

inline Path path_for(int64_t D) {
#ifdef TRIPTYCH_V512
  if (D % 16 == 0 && D >= 64) return Path::v512;
#endif
#ifdef TRIPTYCH_V256
  if (D % 8 == 0) return Path::v256;
#endif
  (void)D;
  return Path::portable;
}

template <typename Fmt>
inline void scores(Path path, const float* qf, const typename Fmt::T* kb, int64_t row,
                   int64_t n, int64_t G, int64_t D, int64_t bs, float* s) {
#ifdef TRIPTYCH_V512
  if (path == Path::v512) return block_scores<V512, Fmt>(qf, kb, row, n, G, D, bs, s);
#endif
#ifdef TRIPTYCH_V256
  if (path == Path::v256) return block_scores<V256, Fmt>(qf, kb, row, n, G, D, bs, s);
#endif
  (void)path;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) s[g * bs + t] = dot<Fmt>(&qf[g * D], kb + t * row, D);
}

template <typename Fmt>
inline void pv(Path path, const float* p, const typename Fmt::T* vb, int64_t row, int64_t n,
               int64_t G, int64_t D, int64_t bs, float* acc) {
#ifdef TRIPTYCH_V512
  if (path == Path::v512) return block_pv<V512, Fmt>(p, vb, row, n, G, D, bs, acc);
#endif
#ifdef TRIPTYCH_V256
  if (path == Path::v256) return block_pv<V256, Fmt>(p, vb, row, n, G, D, bs, acc);
#endif
  (void)path;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) axpy<Fmt>(&acc[g * D], p[g * bs + t], vb + t * row, D);
}

// Blocks sit anywhere in the cache (the block table's order, not memory's), so the
// hardware prefetcher cannot run ahead of a sequence: past what the caches hold (long
// contexts, big batches) the kernel waited on memory, ~8 GB/s of K/V on one Zen 4 core.
// Each 64-byte line of the next block's rows of this head is asked for ahead.
template <typename T>
inline void prefetch_rows(const T* k, const T* v, int64_t row, int64_t n, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t) {
    const char* kr = reinterpret_cast<const char*>(k + t * row);
    const char* vr = reinterpret_cast<const char*>(v + t * row);
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(kr + off, 0, 3);
      __builtin_prefetch(vr + off, 0, 3);
    }
  }
}

template <typename Fmt>
void decode(const typename Fmt::T* q, const typename Fmt::T* kc, const typename Fmt::T* vc,
            const int32_t* tables, const int32_t* lens, typename Fmt::T* out, int64_t H,
            int64_t Hkv, int64_t D, int64_t bs, int64_t max_blocks, float scale, int64_t i0,
            int64_t i1, float* scratch) {
  using T = typename Fmt::T;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements between consecutive tokens of one block
  const Path path = path_for(D);
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
      if (start + bs < len) {  // the next block's rows of this head, while this one runs
        const int64_t nb = (static_cast<int64_t>(table[j + 1]) * bs * Hkv + h) * D;
        const int64_t m2 = len - start - bs < bs ? len - start - bs : bs;
        prefetch_rows(kc + nb, vc + nb, row, m2, D);
      }
      scores<Fmt>(path, qf, kb, row, n, G, D, bs, s);
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
      pv<Fmt>(path, s, vb, row, n, G, D, bs, acc);
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
