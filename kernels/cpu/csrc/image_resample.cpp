// Pillow's 8-bit resampling passes, bit for bit, vectorised: the resize of the fast image
// preprocessing path (triptych/models/image_ops.py, kernels/cpu/image_resample.py).
// Registered as torch.ops.triptych_image.resample_rows / resample_cols; built on first use by
// kernels/cpu/build.py (g++ -O3 -march=native).
//
// What Pillow computes (libImaging/Resample.c, 8 bits per channel): each output sample of a
// pass is 2^21 + sum_k in[first + k] * w[k] in 32-bit integers, the weights being the
// filter's coefficients normalised to sum 1 and scaled by 2^22 (Pillow's PRECISION_BITS),
// then shifted down by 22 bits and clipped to 0..255. The coefficients come from Python
// (image_resample.py computes them as Pillow does, in float64); here only the passes run,
// with the same integer arithmetic, so the result is Pillow's exactly. (torch's uint8
// antialiased interpolation and Pillow-SIMD take 16-bit weights to multiply-add pairs of
// samples: faster, but a sample in 200 lands a level off.)
//
// resample_rows: out[y, :] from rows first[y] .. first[y] + count[y] of src [H, L]: the
// inner loop runs along the whole row (L = width * channels), contiguous, 16 int32 lanes.
// resample_cols: the same along the width of src [H, W, C]: 16 rows at a time are turned so
// that a column's 16 samples lie side by side (16 x 16 byte tiles on SSE2 registers), the
// taps run over those 16 lanes, and the result is turned back.
// Threads: output rows (resample_rows) or blocks of 16 input rows (resample_cols) split
// over torch's intra-op threads (at::parallel_for); one thread runs inline.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

constexpr int kPrecision = 22;                  // Pillow's PRECISION_BITS
constexpr int32_t kHalf = 1 << (kPrecision - 1);  // its rounding offset
constexpr int kBlock = 16;                      // rows turned at a time in resample_cols

inline uint8_t clip8(int32_t v) {
  v >>= kPrecision;  // arithmetic: a negative sum floors, as Pillow's lookup does
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

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
                b[2 * i] + b[2 * i + 1] <= in_size, "bounds outside the input");
  }
}

// src [H, L] -> [out, L]
at::Tensor resample_rows(const at::Tensor& src, const at::Tensor& bounds,
                         const at::Tensor& weights) {
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
    std::vector<int32_t> acc(L);
    for (int64_t y = begin; y < end; ++y) {
      int32_t* a = acc.data();
      std::fill(a, a + L, kHalf);
      const int32_t first = bp[2 * y], count = bp[2 * y + 1];
      for (int32_t k = 0; k < count; ++k) {
        const uint8_t* row = sp + (first + k) * L;
        const int32_t w = wp[y * taps + k];
        for (int64_t i = 0; i < L; ++i) a[i] += static_cast<int32_t>(row[i]) * w;
      }
      uint8_t* o = op + y * L;
      for (int64_t i = 0; i < L; ++i) o[i] = clip8(a[i]);
    }
  });
  return out;
}

// dst[i * ds + j] = src[j * ss + i] for i, j < 16: one 16 x 16 tile of bytes turned, in
// four rounds of interleaves (bytes, pairs, quads, halves) on SSE2 registers.
inline void turn16(const uint8_t* src, int64_t ss, uint8_t* dst, int64_t ds) {
#if defined(__SSE2__)
  __m128i a[16], b[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * ss));
  for (int i = 0; i < 8; ++i) {  // rows 2i, 2i+1: columns 0-7, 8-15
    b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3: columns 0-3, 4-7, 8-11, 12-15
    a[4 * i] = _mm_unpacklo_epi16(b[4 * i], b[4 * i + 2]);
    a[4 * i + 1] = _mm_unpackhi_epi16(b[4 * i], b[4 * i + 2]);
    a[4 * i + 2] = _mm_unpacklo_epi16(b[4 * i + 1], b[4 * i + 3]);
    a[4 * i + 3] = _mm_unpackhi_epi16(b[4 * i + 1], b[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 8i..8i+7: column pairs (2q, 2q+1) in b[8i + q]
    for (int m = 0; m < 4; ++m) {
      b[8 * i + 2 * m] = _mm_unpacklo_epi32(a[8 * i + m], a[8 * i + 4 + m]);
      b[8 * i + 2 * m + 1] = _mm_unpackhi_epi32(a[8 * i + m], a[8 * i + 4 + m]);
    }
  }
  for (int q = 0; q < 8; ++q) {  // all 16 rows of columns 2q, 2q+1
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * q) * ds),
                     _mm_unpacklo_epi64(b[q], b[8 + q]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * q + 1) * ds),
                     _mm_unpackhi_epi64(b[q], b[8 + q]));
  }
#else
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) dst[i * ds + j] = src[j * ss + i];
#endif
}

// dst[j * 16 + r] = src[r * ss + j] for r < rows, j < n (rows < 16: the rest left as is)
void turn_in(const uint8_t* src, int64_t ss, int64_t rows, int64_t n, uint8_t* dst) {
  int64_t j = 0;
  if (rows == kBlock)
    for (; j + 16 <= n; j += 16) turn16(src + j, ss, dst + j * kBlock, kBlock);
  for (; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r) dst[j * kBlock + r] = src[r * ss + j];
}

// dst[r * ds + j] = src[j * 16 + r] for r < rows, j < n
void turn_out(const uint8_t* src, int64_t rows, int64_t n, uint8_t* dst, int64_t ds) {
  int64_t j = 0;
  if (rows == kBlock)
    for (; j + 16 <= n; j += 16) turn16(src + j * kBlock, kBlock, dst + j, ds);
  for (; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r) dst[r * ds + j] = src[j * kBlock + r];
}

// src [H, W, C] -> [H, out, C]
at::Tensor resample_cols(const at::Tensor& src, const at::Tensor& bounds,
                         const at::Tensor& weights) {
  TORCH_CHECK(src.dim() == 3, "src: [height, width, channels]");
  check(src, bounds, weights, src.size(1));
  const int64_t H = src.size(0), W = src.size(1), C = src.size(2);
  const int64_t n_out = bounds.size(0), taps = weights.size(1);
  at::Tensor out = at::empty({H, n_out, C}, src.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int32_t* bp = bounds.data_ptr<int32_t>();
  const int32_t* wp = weights.data_ptr<int32_t>();
  const int64_t n_blocks = (H + kBlock - 1) / kBlock;
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    // the block's samples column by column: in[(x * C + c) * kBlock + r]; res likewise
    std::vector<uint8_t> in(W * C * kBlock, 0);
    std::vector<uint8_t> res(n_out * C * kBlock);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kBlock, rows = std::min<int64_t>(kBlock, H - r0);
      turn_in(sp + r0 * W * C, W * C, rows, W * C, in.data());
      for (int64_t x = 0; x < n_out; ++x) {
        const int32_t first = bp[2 * x], count = bp[2 * x + 1];
        const int32_t* w = wp + x * taps;
        for (int64_t c = 0; c < C; ++c) {
          int32_t acc[kBlock];
          for (int r = 0; r < kBlock; ++r) acc[r] = kHalf;
          for (int32_t k = 0; k < count; ++k) {
            const uint8_t* s = in.data() + ((first + k) * C + c) * kBlock;
            const int32_t wk = w[k];
            for (int r = 0; r < kBlock; ++r) acc[r] += static_cast<int32_t>(s[r]) * wk;
          }
          uint8_t* o = res.data() + (x * C + c) * kBlock;
          for (int r = 0; r < kBlock; ++r) o[r] = clip8(acc[r]);
        }
      }
      turn_out(res.data(), rows, n_out * C, op + r0 * n_out * C, n_out * C);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_image, m) {
  m.def("resample_rows(Tensor src, Tensor bounds, Tensor weights) -> Tensor");
  m.def("resample_cols(Tensor src, Tensor bounds, Tensor weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_image, CPU, m) {
  m.impl("resample_rows", &resample_rows);
  m.impl("resample_cols", &resample_cols);
}
