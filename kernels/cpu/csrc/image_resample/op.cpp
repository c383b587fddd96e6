// Pillow's 8-bit resampling passes, bit for bit, vectorised: the resize of the fast image
// preprocessing path (triptych/models/image_ops.py, kernels/cpu/image_resample.py).
// Registered as torch.ops.triptych_image.{resample_rows, resample_cols, variants}; built on
// first use by kernels/cpu/build.py with one copy of kernels.cpp per instruction-set
// variant; the calls name the variant (kernels/cpu/isa.py, chosen by engine/device/platform.py).
//
//   resample_rows(src [H, L] u8, bounds [out, 2] i32, weights [out, taps] i32, variant)
//       -> [out, L] u8: the vertical pass over rows of L = width * channels samples
//   resample_cols(src [H, W, C] u8, bounds [out, 2] i32, weights [out, taps] i32, variant)
//       -> [H, out, C] u8: the horizontal pass
//
// The coefficients come from Python (image_resample.py computes them as Pillow does, in
// float64); here only the passes run, with Pillow's integer arithmetic (kernels.cpp), so the
// result is Pillow's exactly in every variant. (torch's uint8 antialiased interpolation and
// Pillow-SIMD take 16-bit weights to multiply-add pairs of samples: faster, but a sample in
// 200 lands a level off.)
//
// Threads: output rows (resample_rows) or blocks of 16 input rows (resample_cols) split over
// torch's intra-op threads (at::parallel_for); one thread runs inline.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../variants.h"
#include "kernels.h"

namespace {

using triptych::kResampleBlock;
using triptych::ResampleKernels;

const ResampleKernels* const kTables[triptych::kVariants] = TRIPTYCH_TABLES(triptych::resample);

std::vector<int64_t> variants() { return triptych::built_variants(); }

// every tap of every output inside the input: the kernels index without checking
void check(const at::Tensor& src, const at::Tensor& bounds, const at::Tensor& weights,
           int64_t in_size) {
  TORCH_CHECK(src.scalar_type() == at::kByte && src.is_contiguous(), "src: contiguous uint8");
  TORCH_CHECK(bounds.scalar_type() == at::kInt && bounds.is_contiguous() && bounds.dim() == 2 &&
              bounds.size(1) == 2, "bounds: contiguous int32 [out, 2]");
  TORCH_CHECK(weights.scalar_type() == at::kInt && weights.is_contiguous() &&
              weights.dim() == 2 && weights.size(0) == bounds.size(0),
              "weights: contiguous int32 [out, taps]");
  const int32_t* b = bounds.data_ptr<int32_t>();
  for (int64_t i = 0; i < bounds.size(0); ++i) {
    TORCH_CHECK(b[2 * i] >= 0 && b[2 * i + 1] >= 0 && b[2 * i + 1] <= weights.size(1) &&
                static_cast<int64_t>(b[2 * i]) + b[2 * i + 1] <= in_size,
                "bounds outside the input");
  }
}

at::Tensor resample_rows(const at::Tensor& src, const at::Tensor& bounds,
                         const at::Tensor& weights, int64_t variant) {
  const ResampleKernels& kern = triptych::pick(kTables, variant, "resample_rows");
  TORCH_CHECK(src.dim() == 2, "src: [rows, row length]");
  check(src, bounds, weights, src.size(0));
  const int64_t L = src.size(1), n_out = bounds.size(0), taps = weights.size(1);
  at::Tensor out = at::empty({n_out, L}, src.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int32_t* bp = bounds.data_ptr<int32_t>();
  const int32_t* wp = weights.data_ptr<int32_t>();
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, L * taps));
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    kern.rows(sp, L, bp, wp, taps, op, begin, end);
  });
  return out;
}

at::Tensor resample_cols(const at::Tensor& src, const at::Tensor& bounds,
                         const at::Tensor& weights, int64_t variant) {
  const ResampleKernels& kern = triptych::pick(kTables, variant, "resample_cols");
  TORCH_CHECK(src.dim() == 3, "src: [height, width, channels]");
  check(src, bounds, weights, src.size(1));
  const int64_t H = src.size(0), W = src.size(1), C = src.size(2);
  const int64_t n_out = bounds.size(0), taps = weights.size(1);
  at::Tensor out = at::empty({H, n_out, C}, src.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int32_t* bp = bounds.data_ptr<int32_t>();
  const int32_t* wp = weights.data_ptr<int32_t>();
  const int64_t n_blocks = (H + kResampleBlock - 1) / kResampleBlock;
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    // zeroed: a last block of fewer rows computes its unused lanes from defined bytes
    std::vector<uint8_t> in(W * C * kResampleBlock, 0);
    std::vector<uint8_t> res(n_out * C * kResampleBlock);
    kern.cols(sp, H, W, C, bp, wp, taps, n_out, op, in.data(), res.data(), begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_image, m) {
  m.def("variants() -> int[]", &variants);
  m.def("resample_rows(Tensor src, Tensor bounds, Tensor weights, int variant) -> Tensor");
  m.def("resample_cols(Tensor src, Tensor bounds, Tensor weights, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_image, CPU, m) {
  m.impl("resample_rows", &resample_rows);
  m.impl("resample_cols", &resample_cols);
}
