// The panel GEMM's entry points, one table per instruction-set variant (kernels.cpp,
// compiled once per variant; op.cpp calls the table the platform chose).
//
// Panels (op.cpp's pack, the same for every variant): W [N, K] cut into panels of 16
// output columns, each K-major: fp32 [P, K, 16]; bf16 [P, ceil(K/2), 16, 2] (two
// consecutive k per 32-bit lane); zero padded. A "group" is the panels one register tile
// covers: the unit split over threads.
#pragma once

#include <cstdint>

namespace triptych {

struct PanelKernels {
  int64_t f32_group;   // panels per fp32 register tile
  int64_t bf16_group;  // panels per bf16 register tile
  bool bf16_pairs_x;   // the bf16 kernel takes x rounded to bf16 in pairs (vdpbf16ps)
  // y[:, columns of panel groups [g0, g1)] = x [M, K] @ panels (+ bias); y rows ld apart
  void (*f32)(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
              int64_t N, const float* bias, float* y, int64_t ld, int64_t g0, int64_t g1);
  // the same for bf16 panels: xf is x in fp32 [M, K]; xb (when bf16_pairs_x) x rounded to
  // bf16, two k per uint32 [M, ceil(K/2)]
  void (*bf16)(const float* xf, const uint32_t* xb, int64_t M, int64_t K,
               const uint16_t* panels, int64_t P, int64_t N, const float* bias, float* y,
               int64_t g0, int64_t g1);
  // argmax over the columns of panel groups [g0, g1) of x @ panels (+ bias), per row: the
  // first column of the largest value, a NaN winning (torch.argmax). best_v / best_i [M]
  // carry the result across calls (best_i < 0: nothing yet); buf: M * f32_group * 16 floats
  void (*f32_argmax)(const float* x, int64_t M, int64_t K, const float* panels, int64_t P,
                     int64_t N, const float* bias, int64_t g0, int64_t g1, float* buf,
                     float* best_v, int64_t* best_i);
  // the first index of r[0, V)'s largest value, a NaN winning
  int64_t (*row_argmax)(const float* r, int64_t V);
  // w[i] = e^((r[i] - top) * inv) for r[0, V) (r[i] <= top), exactly 0 where r[i] is -inf:
  // a sampler row's unnormalised probabilities (op.cpp's draw)
  void (*row_weights)(const float* r, int64_t V, float top, float inv, float* w);
};

extern const PanelKernels panel_v0, panel_v1, panel_v2, panel_v3;

}  // namespace triptych
