// Batched CPU GEMM on a panel-packed weight, a row argmax and a row draw, as torch ops.
// Registered as torch.ops.triptych_panel.{variants, pack, gemm, gemm_argmax, argmax, draw};
// built on first use
// by kernels/cpu/build.py with one copy of kernels.cpp per instruction-set variant; every
// call but pack names the variant (kernels/cpu/isa.py, chosen by engine/device/platform.py).
//
//   pack(w [N, K] fp32, bf16) -> panels: W cut into panels of 16 output columns, each
//       stored K-major: fp32 [ceil(N/16), K, 16]; bf16 [ceil(N/16), ceil(K/2), 16, 2]
//       (two consecutive k per 32-bit lane, the operand vdpbf16ps takes); zero padded.
//       The same layout for every variant.
//   gemm(x [M, K] fp32, panels, N, bias?, threads, variant) -> y [M, N] fp32, fp32
//       accumulation (bf16: kernels.cpp says how each variant multiplies).
//   gemm_argmax(x, fp32 panels, N, bias?, threads, variant) -> [M] int64: argmax(gemm(...))
//       without the [M, N] logits: greedy tokens straight from the LM head.
//   argmax(logits [M, V] fp32, threads, variant) -> [M] int64: the first index of each row's
//       largest value (a NaN counts as largest, as torch.argmax); rows split over threads.
//   draw(logits [S, V] fp32, rows [R] int64, temperature [R] fp32, u [R] fp64, ids [S]
//       int64, threads, variant): for each row r = rows[j], ids[r] = the token of the inverse CDF of
//       softmax(logits[r] / temperature[j]) at u[j] (the first token whose cumulative
//       probability, in fp64, exceeds u[j] x the total: a zero-probability token is never
//       drawn), written in place. A row that has no finite distribution (a NaN, +inf, or
//       every logit -inf) keeps its ids entry (the caller's argmax). The sampler's plain
//       random rows on the CPU in one call instead of ~13 small torch ops (sampler.py).
//
// Why (docs/performance.md, "Batch 32"): at 32 rows the bench LM's step is FLOPs, and
// oneDNN's fp32 inner product on its own blocked weight ran the 152k x 512 head at ~90
// GFLOP/s on 2 cores; register tiles over the whole K with the panel group in L2 and x in
// L1/L2 read each weight once per call and need no horizontal sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../variants.h"
#include "kernels.h"

namespace {

using triptych::PanelKernels;

constexpr int64_t NR = 16;

const PanelKernels* const kTables[triptych::kVariants] = TRIPTYCH_TABLES(triptych::panel);

std::vector<int64_t> variants() { return triptych::built_variants(); }

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

const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              op, ": bias must be [N] float32");
  return bias->data_ptr<float>();
}

// panel groups per thread: one chunk of groups per thread
int64_t group_grain(int64_t groups, int64_t threads) {
  threads = std::max<int64_t>(threads, 1);
  return std::max<int64_t>(1, (groups + threads - 1) / threads);
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                const c10::optional<at::Tensor>& bias, int64_t threads, int64_t variant) {
  const PanelKernels& kern = triptych::pick(kTables, variant, "panel gemm");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gemm: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(panels.dim() >= 3 && panels.is_contiguous(), "gemm: panels come from pack()");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(P == (N + NR - 1) / NR, "gemm: panels do not hold ", N, " columns");
  const float* bp = checked_bias(bias, N, "gemm");
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  if (panels.scalar_type() == at::kFloat) {
    TORCH_CHECK(panels.size(1) == K, "gemm: fp32 panels of another K than x's");
    const float* wp = panels.data_ptr<float>();
    const int64_t groups = (P + kern.f32_group - 1) / kern.f32_group;
    at::parallel_for(0, groups, group_grain(groups, threads), [&](int64_t b, int64_t e) {
      kern.f32(xp, M, K, wp, P, N, bp, yp, N, b, e);
    });
    return y;
  }
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16, "gemm: panels must be float32 or bfloat16");
  const int64_t K2 = (K + 1) / 2;
  TORCH_CHECK(panels.size(1) == K2, "gemm: bf16 panels of another K than x's");
  std::vector<uint32_t> xb;
  if (kern.bf16_pairs_x) {  // x rounded to bf16 (nearest even) in pairs; an odd K's last
    xb.assign(M * K2, 0);   // pair has a zero high half
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k)
        xb[m * K2 + k / 2] |= static_cast<uint32_t>(c10::BFloat16(xp[m * K + k]).x)
                              << (16 * (k % 2));
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<c10::BFloat16>());
  const int64_t groups = (P + kern.bf16_group - 1) / kern.bf16_group;
  at::parallel_for(0, groups, group_grain(groups, threads), [&](int64_t b, int64_t e) {
    kern.bf16(xp, xb.data(), M, K, wp, P, N, bp, yp, b, e);
  });
  return y;
}

// Each chunk of panel groups keeps, per row, its first largest column (kernels.cpp); the
// chunks, taken in column order, are merged the same way. Equal to argmax(gemm(...)) (the
// same tile sums).
at::Tensor gemm_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                       const c10::optional<at::Tensor>& bias, int64_t threads, int64_t variant) {
  const PanelKernels& kern = triptych::pick(kTables, variant, "panel gemm_argmax");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gemm_argmax: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat,
              "gemm_argmax: fp32 panels from pack()");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(P == (N + NR - 1) / NR && panels.size(1) == K && N > 0,
              "gemm_argmax: panels do not hold ", N, " columns of x's K");
  const float* bp = checked_bias(bias, N, "gemm_argmax");
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
  const int64_t groups = (P + kern.f32_group - 1) / kern.f32_group;
  const int64_t grain = group_grain(groups, threads);
  const int64_t chunks = (groups + grain - 1) / grain;
  std::vector<float> best_v(chunks * M);
  std::vector<int64_t> best_i(chunks * M, -1);
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    std::vector<float> buf(M * kern.f32_group * NR);
    for (int64_t ch = cb; ch < ce; ++ch)
      kern.f32_argmax(xp, M, K, wp, P, N, bp, ch * grain, std::min(groups, (ch + 1) * grain),
                      buf.data(), best_v.data() + ch * M, best_i.data() + ch * M);
  });
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

at::Tensor argmax(const at::Tensor& logits, int64_t threads, int64_t variant) {
  const PanelKernels& kern = triptych::pick(kTables, variant, "argmax");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous() && logits.size(1) > 0,
              "argmax: logits must be a contiguous [M, V>0] float32 tensor");
  const int64_t M = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({M}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, group_grain(M, threads), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) op[m] = kern.row_argmax(lp + m * V, V);
  });
  return out;
}

void draw(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperature,
          const at::Tensor& u, const at::Tensor& ids, int64_t threads, int64_t variant) {
  const PanelKernels& kern = triptych::pick(kTables, variant, "draw");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous() && logits.size(1) > 0,
              "draw: logits must be a contiguous [S, V>0] float32 tensor");
  const int64_t S = logits.size(0), V = logits.size(1), R = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                  temperature.numel() == R && u.scalar_type() == at::kDouble &&
                  u.is_contiguous() && u.numel() == R,
              "draw: rows int64 [R], temperature float32 [R], u float64 [R]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == S,
              "draw: ids must be a contiguous int64 [S] tensor");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < S, "draw: row ", rp[j], " out of range");
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = ids.data_ptr<int64_t>();
  at::parallel_for(0, R, group_grain(R, threads), [&](int64_t b, int64_t e) {
    std::vector<float> w(V);
    std::vector<double> cdf(V);
    for (int64_t j = b; j < e; ++j) {
      const float* x = lp + rp[j] * V;
      float top = -INFINITY;
      int bad = 0;  // a NaN or +inf: no distribution
#pragma omp simd reduction(max : top) reduction(| : bad)
      for (int64_t i = 0; i < V; ++i) {
        top = std::max(top, x[i]);
        bad |= static_cast<int>(x[i] != x[i]) | static_cast<int>(x[i] == INFINITY);
      }
      if (bad || top == -INFINITY) continue;
      kern.row_weights(x, V, top, 1.0f / tp[j], w.data());  // (a masked token: 0)
      double total = 0.0;
      for (int64_t i = 0; i < V; ++i) cdf[i] = total += w[i];
      const int64_t at = std::upper_bound(cdf.begin(), cdf.end(), up[j] * total) - cdf.begin();
      op[rp[j]] = std::min(at, V - 1);
    }
  });
}

}  // namespace

TORCH_LIBRARY(triptych_panel, m) {
  m.def("variants() -> int[]", &variants);
  m.def("pack(Tensor w) -> Tensor");
  m.def("gemm(Tensor x, Tensor panels, int n, Tensor? bias, int threads, int variant) -> Tensor");
  m.def("argmax(Tensor logits, int threads, int variant) -> Tensor");
  m.def("draw(Tensor logits, Tensor rows, Tensor temperature, Tensor u, Tensor(a!) ids, "
        "int threads, int variant) -> ()");
  m.def("gemm_argmax(Tensor x, Tensor panels, int n, Tensor? bias, int threads, int variant) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_panel, CPU, m) {
  m.impl("pack", &pack);
  m.impl("gemm", &gemm);
  m.impl("argmax", &argmax);
  m.impl("draw", &draw);
  m.impl("gemm_argmax", &gemm_argmax);
}
