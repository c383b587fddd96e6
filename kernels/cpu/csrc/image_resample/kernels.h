// The resize passes' entry points, one table per instruction-set variant (kernels.cpp,
// compiled once per variant; op.cpp checks the arguments, allocates, splits the work over
// threads and calls the table the platform chose).
//
// Both passes take Pillow's taps of one pass: bounds [n_out, 2] (first input, count) and
// weights [n_out, taps] (22-bit fixed point); every output sample is Pillow's 8-bit one.
#pragma once

#include <cstdint>

namespace triptych {

// the rows of one 16-row block of resample_cols, turned so a column's samples are adjacent
constexpr int64_t kResampleBlock = 16;

struct ResampleKernels {
  // Output rows [y0, y1) of out [n_out, L] from the rows of src [*, L].
  void (*rows)(const uint8_t* src, int64_t L, const int32_t* bounds, const int32_t* weights,
               int64_t taps, uint8_t* out, int64_t y0, int64_t y1);
  // Blocks [b0, b1) of kResampleBlock input rows: out [H, n_out, C] from src [H, W, C]
  // along the width; in: W * C * kResampleBlock bytes and res: n_out * C * kResampleBlock
  // bytes of scratch (the caller's, one pair per thread).
  void (*cols)(const uint8_t* src, int64_t H, int64_t W, int64_t C, const int32_t* bounds,
               const int32_t* weights, int64_t taps, int64_t n_out, uint8_t* out, uint8_t* in,
               uint8_t* res, int64_t b0, int64_t b1);
};

extern const ResampleKernels resample_v0, resample_v1, resample_v2, resample_v3;

}  // namespace triptych
