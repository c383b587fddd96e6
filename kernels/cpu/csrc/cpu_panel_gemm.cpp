// Batched CPU GEMM on a panel-packed weight, and a row argmax, for the CPU decode step.
// Registered as torch.ops.triptych_panel.{pack, gemm, argmax}; built on first use by
// triptych/kernels/cpu_build.py (g++ -O3 -march=native). AVX-512 only: on other CPUs the
// ops refuse (`supported()` says which formats run) and callers keep the library GEMMs.
//
//   pack(w [N, K] fp32, bf16) -> panels: W cut into panels of 16 output columns, each
//       stored K-major: fp32 [ceil(N/16), K, 16]; bf16 [ceil(N/16), ceil(K/2), 16, 2]
//       (two consecutive k per 32-bit lane, the operand vdpbf16ps takes); zero padded.
//   gemm(x [M, K] fp32, panels, N, bias?, grain) -> y [M, N] fp32, fp32 accumulation. bf16
//       rounds x to bf16 (nearest even) and multiplies pairs with vdpbf16ps (AVX512-BF16):
//       the same rounding as the oneDNN bf16 path it replaces, fp32 out.
//   argmax(logits [M, V] fp32) -> [M] int64: the first index of each row's largest value
//       (a NaN counts as largest, as torch.argmax); rows split over the threads.
//
// Why (docs/performance.md, "Batch 32"): at 32 rows the bench LM's step is FLOPs, and
// oneDNN's fp32 inner product on its own blocked weight ran the 152k x 512 head at ~90
// GFLOP/s on 2 cores. Here a register tile of 8 rows x 48 columns (24 zmm accumulators;
// one x value broadcast per row and k, three weight vectors per k) runs over the whole K
// with the panel group in L2 and x in L1/L2: no horizontal sums, one weight read per call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TRIPTYCH_PANEL_AVX512 1
#if defined(__AVX512BF16__)
#define TRIPTYCH_PANEL_BF16 1
#endif
#endif

namespace {

constexpr int64_t NR = 16;  // columns per panel (one zmm)
constexpr int MR = 8;       // rows per register tile
constexpr int NP = 3;       // panels per register tile

#ifdef TRIPTYCH_PANEL_AVX512
// One register tile: rows [0, mr) of x (stride K) against np panels (fp32, K-major).
template <int mr, int np>
inline void tile_f32(const float* x, int64_t K, const float* wp, int64_t pstride, float* y,
                     int64_t N, int64_t n0, const float* bias, int64_t ld) {
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
    const int64_t c = n0 + j * NR;
    const int64_t left = N - c;
    const __mmask16 m = left >= NR ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + c) : _mm512_setzero_ps();
    for (int i = 0; i < mr; ++i) _mm512_mask_storeu_ps(y + i * ld + c, m, _mm512_add_ps(acc[i][j], b));
  }
}
#endif

#ifdef TRIPTYCH_PANEL_BF16
// bf16: x as pairs of bf16 in 32-bit lanes (stride K2), panels [K2, 16, 2].
template <int mr, int np>
inline void tile_bf16(const uint32_t* x, int64_t K2, const uint16_t* wp, int64_t pstride,
                      float* y, int64_t N, int64_t n0, const float* bias) {
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
    const int64_t c = n0 + j * NR;
    const int64_t left = N - c;
    const __mmask16 m = left >= NR ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + c) : _mm512_setzero_ps();
    for (int i = 0; i < mr; ++i) _mm512_mask_storeu_ps(y + i * N + c, m, _mm512_add_ps(acc[i][j], b));
  }
}
#endif

// Rows of one panel group: full tiles of MR rows, then the rest (mr = 1..7).
template <typename F>
inline void rows(int64_t M, F&& tile) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile(std::integral_constant<int, MR>{}, m);
  switch (M - m) {
    case 7: tile(std::integral_constant<int, 7>{}, m); break;
    case 6: tile(std::integral_constant<int, 6>{}, m); break;
    case 5: tile(std::integral_constant<int, 5>{}, m); break;
    case 4: tile(std::integral_constant<int, 4>{}, m); break;
    case 3: tile(std::integral_constant<int, 3>{}, m); break;
    case 2: tile(std::integral_constant<int, 2>{}, m); break;
    case 1: tile(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

bool supported(int64_t fmt_bits) {
#ifdef TRIPTYCH_PANEL_AVX512
  if (fmt_bits == 32) return true;
#endif
#ifdef TRIPTYCH_PANEL_BF16
  if (fmt_bits == 16) return true;
#endif
  return false;
}

bool supported_op(int64_t fmt_bits) { return supported(fmt_bits); }

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "pack: w must be a contiguous [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  if (w.scalar_type() == at::kFloat) {
    at::Tensor out = at::zeros({P, K, NR}, w.options());
    const float* src = w.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        for (int64_t c = 0; c < NR && p * NR + c < N; ++c)
          for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + c] = src[(p * NR + c) * K + k];
    });
    return out;
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "pack: w must be float32 or bfloat16");
  const int64_t K2 = (K + 1) / 2;
  at::Tensor out = at::zeros({P, K2, NR, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < NR && p * NR + c < N; ++c)
        for (int64_t k = 0; k < K; ++k)
          dst[((p * K2 + k / 2) * NR + c) * 2 + (k % 2)] = src[(p * NR + c) * K + k];
  });
  return out;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                const c10::optional<at::Tensor>& bias, int64_t grain) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gemm: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(panels.dim() >= 3 && panels.is_contiguous(), "gemm: panels come from pack()");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(P == (N + NR - 1) / NR, "gemm: panels do not hold ", N, " columns");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N, "gemm: bias must be [N] float32");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t groups = (P + NP - 1) / NP;
  grain = std::max<int64_t>(1, grain);
  if (panels.scalar_type() == at::kFloat) {
    TORCH_CHECK(supported(32) && panels.size(1) == K, "gemm: fp32 panels need AVX-512 and x's K");
#ifdef TRIPTYCH_PANEL_AVX512
    const float* xp = x.data_ptr<float>();
    const float* wp = panels.data_ptr<float>();
    const int64_t ps = K * NR;
    at::parallel_for(0, groups, grain, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        const int64_t p0 = g * NP, np = std::min<int64_t>(NP, P - p0);
        const float* w = wp + p0 * ps;
        rows(M, [&](auto mr, int64_t m) {
          constexpr int R = decltype(mr)::value;
          if (np == 3) tile_f32<R, 3>(xp + m * K, K, w, ps, yp + m * N, N, p0 * NR, bp, N);
          else if (np == 2) tile_f32<R, 2>(xp + m * K, K, w, ps, yp + m * N, N, p0 * NR, bp, N);
          else tile_f32<R, 1>(xp + m * K, K, w, ps, yp + m * N, N, p0 * NR, bp, N);
        });
      }
    });
#endif
    return y;
  }
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16, "gemm: panels must be float32 or bfloat16");
  const int64_t K2 = (K + 1) / 2;
  TORCH_CHECK(supported(16) && panels.size(1) == K2, "gemm: bf16 panels need AVX512-BF16 and x's K");
#ifdef TRIPTYCH_PANEL_BF16
  // x rounded to bf16 (nearest even) in pairs; an odd K's last pair has a zero high half
  std::vector<uint32_t> xb(M * K2, 0);
  const float* xf = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t h = c10::BFloat16(xf[m * K + k]).x;
      xb[m * K2 + k / 2] |= h << (16 * (k % 2));
    }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<c10::BFloat16>());
  const int64_t ps = K2 * NR * 2;
  at::parallel_for(0, groups, grain, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t p0 = g * NP, np = std::min<int64_t>(NP, P - p0);
      const uint16_t* w = wp + p0 * ps;
      rows(M, [&](auto mr, int64_t m) {
        constexpr int R = decltype(mr)::value;
        const uint32_t* xm = xb.data() + m * K2;
        if (np == 3) tile_bf16<R, 3>(xm, K2, w, ps, yp + m * N, N, p0 * NR, bp);
        else if (np == 2) tile_bf16<R, 2>(xm, K2, w, ps, yp + m * N, N, p0 * NR, bp);
        else tile_bf16<R, 1>(xm, K2, w, ps, yp + m * N, N, p0 * NR, bp);
      });
    }
  });
#endif
  return y;
}

// First index of the row's largest value; NaN wins (torch.argmax's rule).
// Greedy tokens of x @ W^T (+ bias) without the [M, N] logits: each chunk of panel groups
// computes its 48-column tiles into a small buffer (L1/L2) and keeps, per row, the first
// column holding the largest value (NaN wins, as torch.argmax); the chunks, taken in
// column order, are merged the same way. Equal to argmax(gemm(...)) (same tile sums).
at::Tensor gemm_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                       const c10::optional<at::Tensor>& bias, int64_t grain) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gemm_argmax: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat,
              "gemm_argmax: fp32 panels from pack()");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(P == (N + NR - 1) / NR && panels.size(1) == K && N > 0,
              "gemm_argmax: panels do not hold ", N, " columns of x's K");
  TORCH_CHECK(supported(32), "gemm_argmax: fp32 panels need AVX-512");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N, "gemm_argmax: bias must be [N] float32");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
  const int64_t groups = (P + NP - 1) / NP;
  grain = std::max<int64_t>(1, grain);
  const int64_t chunks = (groups + grain - 1) / grain;
  std::vector<float> best_v(chunks * M);
  std::vector<int64_t> best_i(chunks * M);
#ifdef TRIPTYCH_PANEL_AVX512
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const int64_t ps = K * NR, W = NP * NR;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    std::vector<float> buf(M * W);
    for (int64_t ch = cb; ch < ce; ++ch) {
      float* bv = best_v.data() + ch * M;
      int64_t* bi = best_i.data() + ch * M;
      std::fill(bi, bi + M, int64_t{-1});
      const int64_t g1 = std::min(groups, (ch + 1) * grain);
      for (int64_t g = ch * grain; g < g1; ++g) {
        const int64_t p0 = g * NP, np = std::min<int64_t>(NP, P - p0), n0 = p0 * NR;
        const float* w = wp + p0 * ps;
        float* y = buf.data() - n0;  // tile_f32 writes y + i * ld + column
        rows(M, [&](auto mr, int64_t m) {
          constexpr int R = decltype(mr)::value;
          if (np == 3) tile_f32<R, 3>(xp + m * K, K, w, ps, y + m * W, N, n0, bp, W);
          else if (np == 2) tile_f32<R, 2>(xp + m * K, K, w, ps, y + m * W, N, n0, bp, W);
          else tile_f32<R, 1>(xp + m * K, K, w, ps, y + m * W, N, n0, bp, W);
        });
        const int64_t cols = std::min<int64_t>(np * NR, N - n0);
        for (int64_t i = 0; i < M; ++i) {
          const float* r = buf.data() + i * W;
          float v = bv[i];
          int64_t at = bi[i];
          if (at >= 0 && std::isnan(v)) continue;  // a NaN already won this row
          // vector max over the tile's columns; the scalar scan runs only when this tile
          // holds a NaN or beats the row's best so far (rare once a row has a good one)
          __m512 mx = _mm512_set1_ps(-INFINITY);
          bool nan = false;
          for (int64_t c = 0; c < cols; c += NR) {
            const int64_t left = cols - c;
            const __mmask16 mk = left >= NR ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
            const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mk, r + c);
            nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
            mx = _mm512_max_ps(mx, a);
          }
          if (!nan && at >= 0 && !(_mm512_reduce_max_ps(mx) > v)) continue;
          for (int64_t c = 0; c < cols; ++c) {
            if (std::isnan(r[c])) { v = r[c]; at = n0 + c; break; }
            if (at < 0 || r[c] > v) { v = r[c]; at = n0 + c; }
          }
          bv[i] = v;
          bi[i] = at;
        }
      }
    }
  });
#endif
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    float v = best_v[i];
    int64_t at = best_i[i];
    for (int64_t ch = 1; ch < chunks && !std::isnan(v); ++ch) {
      const float cv = best_v[ch * M + i];
      if (std::isnan(cv) || cv > v) { v = cv; at = best_i[ch * M + i]; }
    }
    op[i] = at;
  }
  return out;
}

int64_t row_argmax(const float* r, int64_t V) {
  int64_t best = 0;
  float bv = r[0];
  if (std::isnan(bv)) return 0;
  int64_t v = 1;
#ifdef TRIPTYCH_PANEL_AVX512
  // vector pass: the largest value (NaN makes the unordered compare fire: scalar rescan)
  __m512 mx = _mm512_set1_ps(bv);
  bool nan = false;
  for (; v + 16 <= V; v += 16) {
    const __m512 a = _mm512_loadu_ps(r + v);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
    mx = _mm512_max_ps(mx, a);
  }
  if (!nan) {
    float top = _mm512_reduce_max_ps(mx);
    for (int64_t t = v; t < V; ++t) {
      if (std::isnan(r[t])) return t;
      top = std::max(top, r[t]);
    }
    for (int64_t t = 0; t < V; ++t)
      if (r[t] == top) return t;
  }
  v = 1;
#endif
  for (; v < V; ++v) {
    if (std::isnan(r[v])) return v;
    if (r[v] > bv) { bv = r[v]; best = v; }
  }
  return best;
}

at::Tensor argmax(const at::Tensor& logits, int64_t grain) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous()
                  && logits.size(1) > 0, "argmax: logits must be a contiguous [M, V>0] float32 tensor");
  const int64_t M = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({M}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, grain), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) op[m] = row_argmax(lp + m * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_panel, m) {
  m.def("supported(int bits) -> bool", &supported_op);
  m.def("pack(Tensor w) -> Tensor");
  m.def("gemm(Tensor x, Tensor panels, int n, Tensor? bias, int grain) -> Tensor");
  m.def("argmax(Tensor logits, int grain) -> Tensor");
  m.def("gemm_argmax(Tensor x, Tensor panels, int n, Tensor? bias, int grain) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_panel, CPU, m) {
  m.impl("pack", &pack);
  m.impl("gemm", &gemm);
  m.impl("argmax", &argmax);
  m.impl("gemm_argmax", &gemm_argmax);
}
