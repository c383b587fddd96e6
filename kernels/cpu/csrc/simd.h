// What every csrc/<lib>/kernels.cpp shares: the variant this translation unit is, and the
// scalar conversions it needs, with no torch header.
//
// build.py compiles each kernels.cpp once per instruction-set variant (kernels/cpu/isa.py):
// -DTRIPTYCH_VARIANT=<id> and that variant's -m flags, so the __AVX2__ / __AVX512F__ / ...
// macros below say what this copy may use. The copies are linked into one library beside
// the torch op (op.cpp, compiled once without -m flags), which calls the copy the platform
// chose. NOTE: the copies must not share a symbol the linker could merge: everything here
// is static or in an anonymous namespace, nothing from <vector> / <algorithm> is
// instantiated, and only the table of entry points (TRIPTYCH_TABLE) is exported.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef TRIPTYCH_VARIANT
#error "build.py compiles kernels.cpp with -DTRIPTYCH_VARIANT=<variant id>"
#endif

#define TRIPTYCH_JOIN_(a, b) a##_v##b
#define TRIPTYCH_JOIN(a, b) TRIPTYCH_JOIN_(a, b)
// the exported table of this copy: TRIPTYCH_TABLE(gemv) is gemv_v<id>
#define TRIPTYCH_TABLE(name) TRIPTYCH_JOIN(name, TRIPTYCH_VARIANT)

namespace {

inline float bits_to_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f(uint16_t h) { return bits_to_f(static_cast<uint32_t>(h) << 16); }

// nearest even, NaN to the quiet NaN: c10::BFloat16's rounding
inline uint16_t f_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  const uint32_t u = f_to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if defined(__F16C__)
inline float half_to_f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
// IEEE half <-> float without F16C (the generic copy): exact widening; narrowing rounds
// to nearest even, as c10::Half and vcvtps2ph do
inline float half_to_f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 31) return bits_to_f(sign | 0x7F800000 | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_f(sign);
    int shift = 0;  // subnormal: shift the mantissa up to its leading one
    while (!(man & 0x400)) {
      man <<= 1;
      ++shift;
    }
    return bits_to_f(sign | (static_cast<uint32_t>(113 - shift) << 23) | ((man & 0x3FF) << 13));
  }
  return bits_to_f(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t f_to_half(float f) {
  const uint32_t u = f_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7E00;                  // NaN
  if (a >= 0x477FF000) return sign | 0x7C00;                 // rounds past 65504: inf
  if (a < 0x38800000) {                                      // below 2^-14: subnormal or 0
    // a float's value times 2^24 rounded to an integer is the subnormal's mantissa; adding
    // 0.5 (2^-1) makes the FPU round it at the right bit, nearest even
    const float v = bits_to_f(a) + 0.5f;
    return sign | static_cast<uint16_t>(f_to_bits(v) - 0x3F000000);
  }
  const uint32_t rounded = a + 0xFFF + ((a >> 13) & 1);     // nearest even at bit 13
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}
#endif

}  // namespace
