// Pillow's 8-bit resampling passes, compiled once per instruction-set variant (../simd.h),
// 16 samples at a time in the widest integer vectors each copy has (SSE2 in the generic
// one, AVX2, AVX-512). Every copy computes the same integers, so every copy's bytes are
// Pillow's. The torch ops around them (checks, scratch, threads) are op.cpp.
//
// What Pillow computes (libImaging/Resample.c, 8 bits per channel): each output sample of a
// pass is 2^21 + sum_k in[first + k] * w[k] in 32-bit integers, the weights being the
// filter's coefficients normalised to sum 1 and scaled by 2^22 (Pillow's PRECISION_BITS),
// then shifted down by 22 bits and clipped to 0..255.
//
// rows: out[y, :] from rows first[y] .. first[y] + count[y] of src [H, L]: 16 contiguous
// samples of the row (L = width * channels) at a time, their sums in registers over the taps.
// cols: the same along the width of src [H, W, C]: 16 rows at a time are turned so that a
// column's 16 samples lie side by side (16 x 16 byte tiles on SSE2 registers), the taps run
// over those 16 lanes, and the result is turned back.
#include "../simd.h"
#include "kernels.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

using triptych::kResampleBlock;

constexpr int kPrecision = 22;                    // Pillow's PRECISION_BITS
constexpr int32_t kHalf = 1 << (kPrecision - 1);  // its rounding offset
constexpr int kBlock = static_cast<int>(kResampleBlock);

inline uint8_t clip8(int32_t v) {
  v >>= kPrecision;  // arithmetic: a negative sum floors, as Pillow's lookup does
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// Sixteen int32 sums as the widest vectors this copy has (GCC's generic vectors): one in
// the AVX-512 copies, two in the AVX2 one, four SSE2 registers in the generic one; they stay
// in registers across the taps. Why not plain loops left to the auto-vectoriser: gcc 12 did
// well on one copy and badly on another (the 1080p column pass: 1.0 ms AVX-512 but 6.4 ms
// AVX2 without `omp simd`, 2.9 ms both with it). Widening and narrowing are written per
// instruction set where gcc 12 lowers the generic form through general-purpose registers
// (SSE2 widening, SSE2 / AVX2 narrowing); the multiply-adds are the compiler's.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kVecs = 16 / kLanes;
typedef int32_t I32v __attribute__((vector_size(4 * kLanes)));

struct Sums {
  I32v v[kVecs];
};

inline Sums start16() {
  Sums s;
  for (int j = 0; j < kVecs; ++j) s.v[j] = I32v{} + kHalf;
  return s;
}

// s += p[0..16) * w
inline void add16(Sums& s, const uint8_t* p, int32_t w) {
#if defined(__AVX2__) || !defined(__SSE2__)
  for (int j = 0; j < kVecs; ++j) {
    I32v x;  // vpmovzxbd with AVX2 / AVX-512
    for (int i = 0; i < kLanes; ++i) x[i] = p[j * kLanes + i];
    s.v[j] += x * w;
  }
#else
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), z = _mm_setzero_si128();
  const __m128i lo = _mm_unpacklo_epi8(b, z), hi = _mm_unpackhi_epi8(b, z);
  s.v[0] += reinterpret_cast<I32v>(_mm_unpacklo_epi16(lo, z)) * w;
  s.v[1] += reinterpret_cast<I32v>(_mm_unpackhi_epi16(lo, z)) * w;
  s.v[2] += reinterpret_cast<I32v>(_mm_unpacklo_epi16(hi, z)) * w;
  s.v[3] += reinterpret_cast<I32v>(_mm_unpackhi_epi16(hi, z)) * w;
#endif
}

// o[0..16) = clip8 of each sum
inline void store16(const Sums& s, uint8_t* o) {
#if defined(__AVX512F__)
  const I32v v = s.v[0] >> kPrecision;  // max(v, 0), then vpmovusdb's saturation at 255
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                   _mm512_cvtusepi32_epi8(_mm512_max_epi32(reinterpret_cast<__m512i>(v),
                                                           _mm512_setzero_si512())));
#elif defined(__SSE2__)
  // packs (int32 -> int16, signed saturation) then packus (int16 -> uint8, unsigned
  // saturation): clip to 0..255 exactly
  __m128i q[4];
  std::memcpy(q, s.v, sizeof q);
  for (int j = 0; j < 4; ++j) q[j] = _mm_srai_epi32(q[j], kPrecision);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                   _mm_packus_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3])));
#else
  for (int j = 0; j < kVecs; ++j)
    for (int i = 0; i < kLanes; ++i) o[j * kLanes + i] = clip8(s.v[j][i]);
#endif
}

void rows(const uint8_t* src, int64_t L, const int32_t* bounds, const int32_t* weights,
          int64_t taps, uint8_t* out, int64_t y0, int64_t y1) {
  for (int64_t y = y0; y < y1; ++y) {
    const int32_t first = bounds[2 * y], count = bounds[2 * y + 1];
    const uint8_t* in = src + first * L;
    const int32_t* w = weights + y * taps;
    uint8_t* o = out + y * L;
    int64_t i = 0;
    for (; i + 16 <= L; i += 16) {  // 16 samples of the row, every tap, in registers
      Sums acc = start16();
      for (int32_t k = 0; k < count; ++k) add16(acc, in + k * L + i, w[k]);
      store16(acc, o + i);
    }
    for (; i < L; ++i) {
      int32_t acc = kHalf;
      for (int32_t k = 0; k < count; ++k) acc += static_cast<int32_t>(in[k * L + i]) * w[k];
      o[i] = clip8(acc);
    }
  }
}

// dst[i * ds + j] = src[j * ss + i] for i, j < 16: one 16 x 16 tile of bytes turned, in
// four rounds of interleaves (bytes, pairs, quads, halves) on SSE2 registers.
inline void turn16(const uint8_t* src, int64_t ss, uint8_t* dst, int64_t ds) {
#if defined(__SSE2__)
  __m128i a[16], b[16];
  for (int r = 0; r < 16; ++r)
    a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * ss));
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

void cols(const uint8_t* src, int64_t H, int64_t W, int64_t C, const int32_t* bounds,
          const int32_t* weights, int64_t taps, int64_t n_out, uint8_t* out, uint8_t* in,
          uint8_t* res, int64_t b0, int64_t b1) {
  // in[(x * C + c) * kBlock + r]: the block's samples column by column; res likewise
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t r0 = blk * kBlock, left = H - r0;
    const int64_t n_rows = left < kBlock ? left : kBlock;
    turn_in(src + r0 * W * C, W * C, n_rows, W * C, in);
    for (int64_t x = 0; x < n_out; ++x) {
      const int32_t first = bounds[2 * x], count = bounds[2 * x + 1];
      const int32_t* w = weights + x * taps;
      for (int64_t c = 0; c < C; ++c) {
        Sums acc = start16();
        for (int32_t k = 0; k < count; ++k) add16(acc, in + ((first + k) * C + c) * kBlock, w[k]);
        store16(acc, res + (x * C + c) * kBlock);
      }
    }
    turn_out(res, n_rows, n_out * C, out + r0 * n_out * C, n_out * C);
  }
}

}  // namespace

namespace triptych {
extern const ResampleKernels TRIPTYCH_TABLE(resample) = {rows, cols};
}  // namespace triptych
