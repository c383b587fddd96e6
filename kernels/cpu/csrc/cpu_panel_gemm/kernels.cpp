// The panel GEMM's kernels, compiled once per instruction-set variant (../simd.h): x [M, K]
// fp32 times a panel-packed weight (kernels.h), and row argmaxes. The torch op around them
// (packing, checks, threads) is op.cpp.
//
//   avx512 / avx512_bf16   register tiles of 8 rows x 48 columns (24 zmm accumulators; one
//                          x value broadcast per row and k, three weight vectors per k)
//                          over the whole K: no horizontal sums, one weight read per call
//   avx2                   6 rows x 16 columns (12 ymm accumulators, Haswell's classic
//                          sgemm tile)
//   generic                one panel at a time in plain loops the compiler vectorises
//
// bf16 panels: avx512_bf16 rounds x to bf16 (nearest even, op.cpp) and multiplies pairs
// with vdpbf16ps, as oneDNN's bf16 path does; the others widen the weight in registers
// (a 32-bit lane holds two k: << 16 gives the even one, the high half the odd one) and
// multiply x in fp32, so the 16-bit weight costs no extra rounding of x.
#include "../exp_neg.h"
#include "../simd.h"
#include "kernels.h"

namespace {

constexpr int64_t NR = 16;  // columns per panel

template <int N>
struct Rows {
  static constexpr int value = N;
};

// Rows in full tiles of MR, then the rest (1 .. MR - 1) as their own tile sizes.
template <int MR, typename F>
inline void rows(int64_t M, F&& tile) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile(Rows<MR>{}, m);
  switch (M - m) {
    case 7: if constexpr (MR > 7) tile(Rows<7>{}, m); break;
    case 6: if constexpr (MR > 6) tile(Rows<6>{}, m); break;
    case 5: if constexpr (MR > 5) tile(Rows<5>{}, m); break;
    case 4: if constexpr (MR > 4) tile(Rows<4>{}, m); break;
    case 3: if constexpr (MR > 3) tile(Rows<3>{}, m); break;
    case 2: if constexpr (MR > 2) tile(Rows<2>{}, m); break;
    case 1: if constexpr (MR > 1) tile(Rows<1>{}, m); break;
    default: break;
  }
}

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Rows in ceil(M / MR) tiles of nearly equal size (MR or one less, ...): 8 rows as 4 + 4,
// not 6 + 2, whose 2-row tile has too few accumulators to hide the FMA's latency.
template <int MR, typename F>
inline void rows_even(int64_t M, F&& tile) {
  const int64_t tiles = (M + MR - 1) / MR;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t n = (M - m) / (tiles - t);  // the rest shared by the tiles left
    switch (n) {
      case 8: if constexpr (MR >= 8) tile(Rows<8>{}, m); break;
      case 7: if constexpr (MR >= 7) tile(Rows<7>{}, m); break;
      case 6: if constexpr (MR >= 6) tile(Rows<6>{}, m); break;
      case 5: tile(Rows<5>{}, m); break;
      case 4: tile(Rows<4>{}, m); break;
      case 3: tile(Rows<3>{}, m); break;
      case 2: tile(Rows<2>{}, m); break;
      case 1: tile(Rows<1>{}, m); break;
      default: break;
    }
    m += n;
  }
}

// Fold a tile's values r[0, cols) (columns n0 ..) into a row's best (v, at): the first
// NaN wins, else the first of the largest values.
inline void scan(const float* r, int64_t cols, int64_t n0, float& v, int64_t& at) {
  for (int64_t c = 0; c < cols; ++c) {
    if (r[c] != r[c]) {
      v = r[c];
      at = n0 + c;
      return;
    }
    if (at < 0 || r[c] > v) {
      v = r[c];
      at = n0 + c;
    }
  }
}

// ------------------------------------------------------------------------------ AVX2
#if defined(__AVX2__) && defined(__FMA__)
constexpr int MR2 = 6;

// Writes a tile's rows (16 columns each, or the first `left`) with the bias added.
// NOTE: every loop over the rows is unrolled: where one was not, GCC kept the accumulators
// in memory and stored all 12 on every k step of the tile's loop (half the speed).
template <int mr>
inline void store_tile(float* y, int64_t ld, __m256 (&acc)[mr][2], const float* bias,
                       int64_t left) {
  alignas(32) float b[NR] = {};
  if (bias)
    for (int64_t c = 0; c < (left < NR ? left : NR); ++c) b[c] = bias[c];
  const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
  if (left >= NR) {
#pragma GCC unroll 8
    for (int i = 0; i < mr; ++i) {
      _mm256_storeu_ps(y + i * ld, _mm256_add_ps(acc[i][0], b0));
      _mm256_storeu_ps(y + i * ld + 8, _mm256_add_ps(acc[i][1], b1));
    }
    return;
  }
  alignas(32) float t[mr][NR];
#pragma GCC unroll 8
  for (int i = 0; i < mr; ++i) {  // NOTE: unrolled, so acc[i] is a register, never memory
    _mm256_store_ps(t[i], _mm256_add_ps(acc[i][0], b0));
    _mm256_store_ps(t[i] + 8, _mm256_add_ps(acc[i][1], b1));
  }
  for (int i = 0; i < mr; ++i)
    for (int64_t c = 0; c < left; ++c) y[i * ld + c] = t[i][c];
}


// Rows [0, mr) of x (stride K) against one fp32 panel wp [K, 16]; y: the tile's first
// column, rows ld apart; `left` valid columns from there.
template <int mr>
inline void tile_f32_avx2(const float* x, int64_t K, const float* wp, float* y, int64_t ld,
                          int64_t left, const float* bias) {
  __m256 acc[mr][2];
  for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wp + k * NR);
    const __m256 w1 = _mm256_loadu_ps(wp + k * NR + 8);
    for (int i = 0; i < mr; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  store_tile<mr>(y, ld, acc, bias, left);
}

// The same against one bf16 panel wp [K2, 16, 2], x in fp32: each 32-bit lane of the
// panel holds k (low half) and k + 1 (high half) of one column.
template <int mr>
inline void tile_bf16_avx2(const float* x, int64_t K, const uint16_t* wp, float* y,
                           int64_t ld, int64_t left, const float* bias) {
  __m256 acc[mr][2];
  for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t k2 = 0; k2 < pairs; ++k2) {
    const __m256i* wv = reinterpret_cast<const __m256i*>(wp + k2 * NR * 2);
    __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wv), 16));
    __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wv + 1), 16));
    for (int i = 0; i < mr; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + 2 * k2);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(wv), 16), 16));
    w1 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(wv + 1), 16), 16));
    for (int i = 0; i < mr; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + 2 * k2 + 1);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  if (K % 2) {  // the last pair holds k = K - 1 only (its high half is padding)
    const __m256i* wv = reinterpret_cast<const __m256i*>(wp + pairs * NR * 2);
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wv), 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wv + 1), 16));
    for (int i = 0; i < mr; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + K - 1);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  store_tile<mr>(y, ld, acc, bias, left);
}

// one panel for every row; y: the panel's first column, rows ld apart
inline void one_panel_f32(const float* x, int64_t M, int64_t K, const float* wp, int64_t left,
                          const float* bias, float* y, int64_t ld) {
  rows_even<MR2>(M, [&](auto mr, int64_t m) {
    tile_f32_avx2<decltype(mr)::value>(x + m * K, K, wp, y + m * ld, ld, left, bias);
  });
}

void f32_avx2(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
              int64_t N, const float* bias, float* y, int64_t ld, int64_t g0, int64_t g1) {
  for (int64_t p = g0; p < g1 && p < P; ++p)
    one_panel_f32(x, M, K, panels + p * K * NR, N - p * NR, bias ? bias + p * NR : nullptr,
                  y + p * NR, ld);
}

void bf16_avx2(const float* xf, const uint32_t*, int64_t M, int64_t K, const uint16_t* panels,
               int64_t P, int64_t N, const float* bias, float* y, int64_t g0, int64_t g1) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t p = g0; p < g1 && p < P; ++p) {
    const int64_t n0 = p * NR;
    const uint16_t* wp = panels + p * K2 * NR * 2;
    const float* b = bias ? bias + n0 : nullptr;
    rows_even<MR2>(M, [&](auto mr, int64_t m) {
      tile_bf16_avx2<decltype(mr)::value>(xf + m * K, K, wp, y + m * N + n0, N, N - n0, b);
    });
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

// ---------------------------------------------------------------------------- AVX-512
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TRIPTYCH_PANEL_AVX512 1
constexpr int MR = 8;  // rows per register tile
constexpr int NP = 3;  // panels per register tile

inline __mmask16 first(int64_t left) {
  return left >= NR ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Rows [0, mr) of x (stride K) against np fp32 panels (K-major, pstride apart); y: the
// tile's first column, rows ld apart; `left` valid columns from there.
template <int mr, int np>
inline void tile_f32(const float* x, int64_t K, const float* wp, int64_t pstride, float* y,
                     int64_t ld, int64_t left, const float* bias) {
  __m512 acc[mr][np];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < np; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[np];
    for (int j = 0; j < np; ++j) w[j] = _mm512_loadu_ps(wp + j * pstride + k * NR);
    for (int i = 0; i < mr; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * K + k]);
      for (int j = 0; j < np; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int j = 0; j < np; ++j) {
    const __mmask16 m = first(left - j * NR);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + j * NR) : _mm512_setzero_ps();
    for (int i = 0; i < mr; ++i)
      _mm512_mask_storeu_ps(y + i * ld + j * NR, m, _mm512_add_ps(acc[i][j], b));
  }
}

// One panel group's tiles over every row: np = 3, or the last group's 1-2 panels.
inline void group_f32(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
                      int64_t N, const float* bias, float* y, int64_t ld, int64_t g) {
  const int64_t p0 = g * NP, np = min64(NP, P - p0), n0 = p0 * NR, ps = K * NR;
  const float* w = panels + p0 * ps;
  const float* b = bias ? bias + n0 : nullptr;
  rows<MR>(M, [&](auto mr, int64_t m) {
    constexpr int R = decltype(mr)::value;
    float* ym = y + m * ld;
    if (np == 3) tile_f32<R, 3>(x + m * K, K, w, ps, ym, ld, N - n0, b);
    else if (np == 2) tile_f32<R, 2>(x + m * K, K, w, ps, ym, ld, N - n0, b);
    else tile_f32<R, 1>(x + m * K, K, w, ps, ym, ld, N - n0, b);
  });
}

void f32_avx512(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
                int64_t N, const float* bias, float* y, int64_t ld, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    group_f32(x, M, K, panels, P, N, bias, y + g * NP * NR, ld, g);
}

// Each group's tiles go to buf (M x 48, in L1/L2); each row keeps its first maximum. The
// vector max over the tile decides whether the scalar scan is needed at all (rare once a
// row has a good value).
void f32_argmax_avx512(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
                       int64_t N, const float* bias, int64_t g0, int64_t g1, float* buf,
                       float* best_v, int64_t* best_i) {
  constexpr int64_t W = NP * NR;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * W, cols = min64(W, N - n0);
    group_f32(x, M, K, panels, P, N, bias, buf, W, g);
    for (int64_t i = 0; i < M; ++i) {
      const float* r = buf + i * W;
      if (best_i[i] >= 0 && best_v[i] != best_v[i]) continue;  // a NaN already won this row
      __m512 mx = _mm512_set1_ps(-__builtin_inff());
      bool nan = false;
      for (int64_t c = 0; c < cols; c += NR) {
        const __m512 a =
            _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), first(cols - c), r + c);
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
        mx = _mm512_max_ps(mx, a);
      }
      if (!nan && best_i[i] >= 0 && !(_mm512_reduce_max_ps(mx) > best_v[i])) continue;
      scan(r, cols, n0, best_v[i], best_i[i]);
    }
  }
}

int64_t row_argmax_avx512(const float* r, int64_t V) {
  if (r[0] != r[0]) return 0;
  // vector pass: the largest value (a NaN makes the unordered compare fire: scalar rescan)
  __m512 mx = _mm512_set1_ps(r[0]);
  bool nan = false;
  int64_t v = 1;
  for (; v + 16 <= V; v += 16) {
    const __m512 a = _mm512_loadu_ps(r + v);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
    mx = _mm512_max_ps(mx, a);
  }
  if (!nan) {
    float top = _mm512_reduce_max_ps(mx);
    for (int64_t t = v; t < V; ++t) {
      if (r[t] != r[t]) return t;
      top = top < r[t] ? r[t] : top;
    }
    for (int64_t t = 0; t < V; ++t)
      if (r[t] == top) return t;
  }
  float bv = r[0];
  int64_t at = 0;
  scan(r + 1, V - 1, 1, bv, at);
  return at;
}
#endif

#if defined(TRIPTYCH_PANEL_AVX512) && defined(__AVX512BF16__)
#define TRIPTYCH_PANEL_BF16 1
// bf16: x as pairs of bf16 in 32-bit lanes (stride K2), panels [K2, 16, 2].
template <int mr, int np>
inline void tile_bf16(const uint32_t* x, int64_t K2, const uint16_t* wp, int64_t pstride,
                      float* y, int64_t ld, int64_t left, const float* bias) {
  __m512 acc[mr][np];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < np; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh w[np];
    for (int j = 0; j < np; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(wp + j * pstride + k * NR * 2);
    for (int i = 0; i < mr; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * K2 + k]));
      for (int j = 0; j < np; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
    }
  }
  for (int j = 0; j < np; ++j) {
    const __mmask16 m = first(left - j * NR);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + j * NR) : _mm512_setzero_ps();
    for (int i = 0; i < mr; ++i)
      _mm512_mask_storeu_ps(y + i * ld + j * NR, m, _mm512_add_ps(acc[i][j], b));
  }
}

void bf16_dot(const float*, const uint32_t* xb, int64_t M, int64_t K, const uint16_t* panels,
              int64_t P, int64_t N, const float* bias, float* y, int64_t g0, int64_t g1) {
  const int64_t K2 = (K + 1) / 2, ps = K2 * NR * 2;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t p0 = g * NP, np = min64(NP, P - p0), n0 = p0 * NR;
    const uint16_t* w = panels + p0 * ps;
    const float* b = bias ? bias + n0 : nullptr;
    rows<MR>(M, [&](auto mr, int64_t m) {
      constexpr int R = decltype(mr)::value;
      const uint32_t* xm = xb + m * K2;
      float* ym = y + m * N + n0;
      if (np == 3) tile_bf16<R, 3>(xm, K2, w, ps, ym, N, N - n0, b);
      else if (np == 2) tile_bf16<R, 2>(xm, K2, w, ps, ym, N, N - n0, b);
      else tile_bf16<R, 1>(xm, K2, w, ps, ym, N, N - n0, b);
    });
  }
}
#endif

// ---------------------------------------------------------------------------- generic
#if !defined(TRIPTYCH_PANEL_AVX512) && !(defined(__AVX2__) && defined(__FMA__))
// one panel for every row; y: the panel's first column, rows ld apart, `left` valid columns
template <typename Weight>
inline void panel_generic(const float* x, int64_t M, int64_t K, int64_t left,
                          const float* bias, float* y, int64_t ld, Weight&& weight) {
  for (int64_t m = 0; m < M; ++m) {
    float acc[NR] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * K + k];
#pragma omp simd
      for (int64_t c = 0; c < NR; ++c) acc[c] += xv * weight(k, c);
    }
    for (int64_t c = 0; c < min64(NR, left); ++c)
      y[m * ld + c] = acc[c] + (bias ? bias[c] : 0.f);
  }
}

inline void one_panel_f32(const float* x, int64_t M, int64_t K, const float* wp, int64_t left,
                          const float* bias, float* y, int64_t ld) {
  panel_generic(x, M, K, left, bias, y, ld, [&](int64_t k, int64_t c) { return wp[k * NR + c]; });
}

void f32_generic(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
                 int64_t N, const float* bias, float* y, int64_t ld, int64_t g0, int64_t g1) {
  for (int64_t p = g0; p < g1 && p < P; ++p)
    one_panel_f32(x, M, K, panels + p * K * NR, N - p * NR, bias ? bias + p * NR : nullptr,
                  y + p * NR, ld);
}

void bf16_generic(const float* xf, const uint32_t*, int64_t M, int64_t K,
                  const uint16_t* panels, int64_t P, int64_t N, const float* bias, float* y,
                  int64_t g0, int64_t g1) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t p = g0; p < g1 && p < P; ++p) {
    const uint16_t* wp = panels + p * K2 * NR * 2;
    panel_generic(xf, M, K, N - p * NR, bias ? bias + p * NR : nullptr, y + p * NR, N,
                  [&](int64_t k, int64_t c) {
                    return bf16_to_f(wp[((k / 2) * NR + c) * 2 + (k % 2)]);
                  });
  }
}
#endif

// argmax for the avx2 and generic copies: tile by tile into buf, then the scan
#if !defined(TRIPTYCH_PANEL_AVX512)
void f32_argmax_tiles(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
                      int64_t N, const float* bias, int64_t g0, int64_t g1, float* buf,
                      float* best_v, int64_t* best_i) {
  for (int64_t p = g0; p < g1 && p < P; ++p) {
    const int64_t n0 = p * NR, cols = min64(NR, N - n0);
    one_panel_f32(x, M, K, panels + p * K * NR, N - n0, bias ? bias + n0 : nullptr, buf, NR);
    for (int64_t i = 0; i < M; ++i) {
      const float* r = buf + i * NR;
      if (best_i[i] >= 0 && best_v[i] != best_v[i]) continue;  // a NaN already won this row
#if defined(__AVX2__)
      if (best_i[i] >= 0 && cols == NR) {  // the scan only where this tile holds a NaN or
        const __m256 a = _mm256_loadu_ps(r), b = _mm256_loadu_ps(r + 8);  // beats the best
        const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q),
                                        _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
        if (_mm256_movemask_ps(nan) == 0 && !(hmax8(_mm256_max_ps(a, b)) > best_v[i])) continue;
      }
#endif
      scan(r, cols, n0, best_v[i], best_i[i]);
    }
  }
}

int64_t row_argmax_plain(const float* r, int64_t V) {
#if defined(__AVX2__)
  if (r[0] != r[0]) return 0;
  __m256 mx = _mm256_set1_ps(r[0]);
  __m256 nan = _mm256_setzero_ps();
  int64_t v = 1;
  for (; v + 8 <= V; v += 8) {
    const __m256 a = _mm256_loadu_ps(r + v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, a);
  }
  if (_mm256_movemask_ps(nan) == 0) {
    float top = hmax8(mx);
    for (int64_t t = v; t < V; ++t) {
      if (r[t] != r[t]) return t;
      top = top < r[t] ? r[t] : top;
    }
    for (int64_t t = 0; t < V; ++t)
      if (r[t] == top) return t;
  }
#endif
  float bv = r[0];
  int64_t at = 0;
  if (bv != bv) return 0;
  scan(r + 1, V - 1, 1, bv, at);
  return at;
}
#endif

// (every variant: the loop the compiler vectorises with its own -m flags)
void row_weights(const float* r, int64_t V, float top, float inv, float* w) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i)
    w[i] = r[i] == -__builtin_inff() ? 0.0f : exp_neg((r[i] - top) * inv);
}

}  // namespace

namespace triptych {
#if defined(TRIPTYCH_PANEL_AVX512)
extern const PanelKernels TRIPTYCH_TABLE(panel) = {
#if defined(TRIPTYCH_PANEL_BF16)
    NP, NP, true, f32_avx512, bf16_dot, f32_argmax_avx512, row_argmax_avx512,
    row_weights};
#else
    NP, 1, false, f32_avx512, bf16_avx2, f32_argmax_avx512, row_argmax_avx512,
    row_weights};
#endif
#elif defined(__AVX2__) && defined(__FMA__)
extern const PanelKernels TRIPTYCH_TABLE(panel) = {
    1, 1, false, f32_avx2, bf16_avx2, f32_argmax_tiles, row_argmax_plain, row_weights};
#else
extern const PanelKernels TRIPTYCH_TABLE(panel) = {
    1, 1, false, f32_generic, bf16_generic, f32_argmax_tiles, row_argmax_plain, row_weights};
#endif
}  // namespace triptych
