// e^x for x <= 0 in a form the compiler vectorises (a libm call stays scalar), torch-free:
// shared by the attention kernels' online softmax and the sampler's draw (panel gemm op).
// e^x = 2^k * 2^f with k = round(x / ln 2), |f| <= 1/2, 2^f by its degree-7 Taylor series
// (relative error < 1e-8, under fp32's epsilon). x below -87 (and -inf) gives ~1e-38, not 0:
// weights that small vanish in every sum they join (a caller that needs an exact 0 for
// -inf says so itself).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float k = __builtin_floorf(t + 0.5f);
  const float f = (t - k) * 0.693147180559945309f;  // f in [-ln2/2, ln2/2]
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace
