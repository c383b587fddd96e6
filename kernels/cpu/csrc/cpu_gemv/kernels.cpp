// The GEMV's kernels, compiled once per instruction-set variant (../simd.h): a batch-1 or
// small-batch decode step's y[M, N] = x[M, K] @ W[N, K]^T for a few rows M, W row-major in
// fp32, bf16, fp16 or int8, fp32 accumulation and out. The torch op around them (checks,
// threads, x's quantization for int8) is op.cpp.
//
// Why: at M = 1 the step only has to stream W from memory once. Each W row is read once,
// in order, into vector accumulators (bf16 / fp16 widened to fp32 in registers); x (a few
// KB) stays in L1 for every row. For M > 1 each W row meets every row of x while it is in
// L1 (the libraries win from M = 2-4 on: cpu_linear.GEMV_MAX_ROWS).
//
//   avx512       one 16-lane accumulator per row, masked tail
//   avx2         four 8-lane accumulators per row (the FMA's latency is 4-5 cycles: one
//                chain would leave the loads waiting), scalar tail
//   generic      `omp simd` loops: the compiler's own vectors for the baseline ISA
//
// int8: x quantized per row to [-127, 127] by op.cpp, exact int32 dot products:
//   avx512_bf16  VNNI vpdpbusd: 64 u8 x s8 products a step, x offset to u8 by 128 and the
//                offset taken back out with the row's weight sum
//   avx2/avx512  vpmaddubsw on |w| and x * sign(w): pair sums of at most 2 * 128 * 127,
//                inside int16, so nothing saturates (no 7-bit activations needed)
//   generic      int32 multiply-adds the compiler vectorises
// Every variant sums the same integers, so int8 outputs are equal bit for bit across them.
#include "../simd.h"
#include "kernels.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 bf16_lanes(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

struct Bf16 {  // tags for the 16-bit formats (both arrive as raw uint16_t bits)
  static __m512 ld(const uint16_t* p) {
    return bf16_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 ld(const uint16_t* p, __mmask16 m) {
    return bf16_lanes(_mm256_maskz_loadu_epi16(m, p));
  }
};
struct F16 {
  static __m512 ld(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 ld(const uint16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
};
struct F32 {
  static __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 ld(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};

template <typename Fmt, typename W>
inline float dot(const float* x, const W* w, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(Fmt::ld(w + k), _mm512_loadu_ps(x + k), acc);
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    acc = _mm512_fmadd_ps(Fmt::ld(w + k, m), _mm512_maskz_loadu_ps(m, x + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Bf16 {
  static __m256 ld(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static float one(uint16_t h) { return bf16_to_f(h); }
};
struct F16 {
  static __m256 ld(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float one(uint16_t h) { return half_to_f(h); }
};
struct F32 {
  static __m256 ld(const float* p) { return _mm256_loadu_ps(p); }
  static float one(float v) { return v; }
};

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <typename Fmt, typename W>
inline float dot(const float* x, const W* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(Fmt::ld(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(Fmt::ld(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(Fmt::ld(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(Fmt::ld(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(Fmt::ld(w + k), _mm256_loadu_ps(x + k), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += x[k] * Fmt::one(w[k]);
  return s;
}
#else
struct Bf16 {
  static float one(uint16_t h) { return bf16_to_f(h); }
};
struct F16 {
  static float one(uint16_t h) { return half_to_f(h); }
};
struct F32 {
  static float one(float v) { return v; }
};

template <typename Fmt, typename W>
inline float dot(const float* x, const W* w, int64_t K) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < K; ++k) s += x[k] * Fmt::one(w[k]);
  return s;
}
#endif

template <typename Fmt, typename W>
void gemv(const float* x, const W* w, const float* scale, const float* bias, float* y,
          int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      float v = dot<Fmt>(x + m * K, wn, K);
      if (scale) v *= scale[n];
      y[m * N + n] = bias ? v + bias[n] : v;
    }
  }
}

// int8's epilogue with separate roundings (no FMA contraction), so every variant's bits agree
__attribute__((optimize("fp-contract=off"))) void s8_out(const int32_t* dots, int64_t nr,
                                                         int64_t n, float xs,
                                                         const float* scale,
                                                         const float* bias, float* y) {
  for (int64_t r = 0; r < nr; ++r) {
    const float v = static_cast<float>(dots[r]) * xs * scale[n + r];
    y[n + r] = bias ? v + bias[n + r] : v;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m128i fold(__m512i v) {
  const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// 4 rows at a time; each row's accumulator folded to 128 bits, the 4 summed by two hadds.
// At K = 512 a row is 8 vpdpbusd, so the horizontal sums matter.
void gemv_s8(const int8_t* xq, const float* xs, int64_t Kp, const int8_t* w,
             const float* scale, const int32_t* wsum, const float* bias, float* y, int64_t M,
             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));  // s8 q -> u8 q + 128
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t nr = n1 - n < 4 ? n1 - n : 4;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* q = xq + m * Kp;
      __m128i part[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(),
                         _mm_setzero_si128()};
      for (int64_t r = 0; r < nr; ++r) {  // one row at a time: one stream through W
        const int8_t* wn = w + (n + r) * K;
        __m512i acc = _mm512_setzero_si512();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64)
          acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(q + k), offset),
                                    _mm512_loadu_si512(wn + k));
        if (k < K)
          acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(q + k), offset),
                                    _mm512_maskz_loadu_epi8((1ULL << (K - k)) - 1, wn + k));
        part[r] = fold(acc);
      }
      alignas(16) int32_t dots[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(dots),
                      _mm_hadd_epi32(_mm_hadd_epi32(part[0], part[1]),
                                     _mm_hadd_epi32(part[2], part[3])));
      for (int64_t r = 0; r < nr; ++r) dots[r] -= 128 * wsum[n + r];
      s8_out(dots, nr, n, xs[m], scale, bias, y + m * N);
    }
  }
}
#elif defined(__AVX2__)
inline __m128i fold(__m256i v) {
  return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

void gemv_s8(const int8_t* xq, const float* xs, int64_t Kp, const int8_t* w,
             const float* scale, const int32_t*, const float* bias, float* y, int64_t M,
             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t nr = n1 - n < 4 ? n1 - n : 4;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* q = xq + m * Kp;
      __m128i part[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(),
                         _mm_setzero_si128()};
      int32_t tail[4] = {0, 0, 0, 0};
      for (int64_t r = 0; r < nr; ++r) {
        const int8_t* wn = w + (n + r) * K;
        __m256i acc = _mm256_setzero_si256();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + k));
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv),
                                                     _mm256_sign_epi8(qv, wv));
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
        }
        for (; k < K; ++k) tail[r] += static_cast<int32_t>(wn[k]) * q[k];
        part[r] = fold(acc);
      }
      alignas(16) int32_t dots[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(dots),
                      _mm_hadd_epi32(_mm_hadd_epi32(part[0], part[1]),
                                     _mm_hadd_epi32(part[2], part[3])));
      for (int64_t r = 0; r < nr; ++r) dots[r] += tail[r];
      s8_out(dots, nr, n, xs[m], scale, bias, y + m * N);
    }
  }
}
#else
void gemv_s8(const int8_t* xq, const float* xs, int64_t Kp, const int8_t* w,
             const float* scale, const int32_t*, const float* bias, float* y, int64_t M,
             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* q = xq + m * Kp;
      int32_t s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += static_cast<int32_t>(wn[k]) * q[k];
      s8_out(&s, 1, n, xs[m], scale, bias, y + m * N);
    }
  }
}
#endif

}  // namespace

namespace triptych {
extern const GemvKernels TRIPTYCH_TABLE(gemv) = {
    gemv<F32, float>, gemv<Bf16, uint16_t>, gemv<F16, uint16_t>, gemv_s8};
}  // namespace triptych
