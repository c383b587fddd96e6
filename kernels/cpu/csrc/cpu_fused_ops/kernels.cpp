// The fused layer ops' kernels, compiled once per instruction-set variant (../simd.h). The
// torch ops around them (checks, threads, the cache write) are op.cpp.
//
// Rounding: rope computes each product and the sum as separate fp32 roundings (no FMA
// contraction), so it equals the torch reference (and HF) bit for bit in every variant;
// the norm sums its squares in the vector width's order (float rounding of the mean
// only); silu(g) * u computes g / (1 + e^-g) and then the product as torch does, with its
// own e^x: a vector polynomial within ~1 ulp of torch's (avx2, avx512), libm's expf
// (generic).
#include "../simd.h"
#include "kernels.h"

namespace {

void rms_rows(const float* x, int64_t xs, const float* r, int64_t rs, const float* w,
              float* y, float* sum, int64_t C, float eps, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* src = x + t * xs;
    if (r) {
      float* s = sum + t * C;
      const float* rr = r + t * rs;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) s[c] = src[c] + rr[c];
      src = s;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += src[c] * src[c];
    const float inv = 1.f / __builtin_sqrtf(ss / static_cast<float>(C) + eps);
    float* out = y + t * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] = w[c] * (src[c] * inv);
  }
}

// separate roundings of both products and the sum: torch_ref's (and HF's) fp32 result
__attribute__((optimize("fp-contract=off"))) void rope(
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

#if defined(__AVX512F__)
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

void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    _mm512_storeu_ps(out + c, silu_mul16(_mm512_loadu_ps(g + c), _mm512_loadu_ps(u + c)));
  if (c < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - c)) - 1);
    _mm512_mask_storeu_ps(out + c, m, silu_mul16(_mm512_maskz_loadu_ps(m, g + c),
                                                 _mm512_maskz_loadu_ps(m, u + c)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp16's polynomial in 8 lanes. AVX2 has no scalef: 2^n is built in the exponent bits,
// as two factors 2^(n/2) and 2^(n - n/2) (each inside the normal range for n in
// [-159, 145]), so overflow to inf and underflow through the subnormals to 0 still come
// from the multiplications themselves. NaN passes through as in exp16.
inline __m256 pow2(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(100.f), _mm256_max_ps(_mm256_set1_ps(-110.f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i k = _mm256_cvtps_epi32(n);  // NaN: garbage exponent, but p is NaN already
  const __m256i k1 = _mm256_srai_epi32(k, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(k1)), pow2(_mm256_sub_epi32(k, k1)));
}

inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm256_storeu_ps(out + c, silu_mul8(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c)));
  if (c < n) {  // the tail through a zero-padded vector
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    for (int64_t i = c; i < n; ++i) {
      gt[i - c] = g[i];
      ut[i - c] = u[i];
    }
    _mm256_store_ps(ot, silu_mul8(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    for (int64_t i = c; i < n; ++i) out[i] = ot[i - c];
  }
}
#else
void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float s = g[c] / (1.f + __builtin_expf(-g[c]));
    out[c] = s * u[c];
  }
}
#endif

void silu_mul_rows(const float* gate_up, int64_t rs, int64_t inter, float* out, int64_t t0,
                   int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    silu_mul_row(gate_up + t * rs, gate_up + t * rs + inter, out + t * inter, inter);
}

}  // namespace

namespace triptych {
extern const FusedKernels TRIPTYCH_TABLE(fused) = {rms_rows, rope, silu_mul_rows};
}  // namespace triptych
