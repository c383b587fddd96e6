// The op side (op.cpp) of a library with one copy of its kernels per instruction-set
// variant (simd.h): which copies this build holds, and the one a call names.
//
// build.py compiles op.cpp with -DTRIPTYCH_BUILT=<bit mask of the variant ids it compiled>
// (kernels/cpu/isa.py: 0 generic, 1 avx2, 2 avx512, 3 avx512_bf16). The Python side asks
// variants() once and passes the id the platform chose with every call.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

#ifndef TRIPTYCH_BUILT
#error "build.py compiles op.cpp with -DTRIPTYCH_BUILT=<mask of the compiled variants>"
#endif

#define TRIPTYCH_HAS(v) ((TRIPTYCH_BUILT >> (v)) & 1)

namespace triptych {

constexpr int kVariants = 4;

// The ids this build holds, for the variants() op.
inline std::vector<int64_t> built_variants() {
  std::vector<int64_t> out;
  for (int v = 0; v < kVariants; ++v)
    if (TRIPTYCH_HAS(v)) out.push_back(v);
  return out;
}

// tables[v] for a variant id the build holds (the others are nullptr)
template <typename Table>
const Table& pick(const Table* const (&tables)[kVariants], int64_t v, const char* lib) {
  TORCH_CHECK(v >= 0 && v < kVariants && tables[v] != nullptr, lib,
              ": this build holds no kernel variant ", v, " (it holds the ids of variants())");
  return *tables[v];
}

}  // namespace triptych

// &name_v<id> where the build compiled that variant, else nullptr
#if TRIPTYCH_HAS(0)
#define TRIPTYCH_V0(name) &name##_v0
#else
#define TRIPTYCH_V0(name) nullptr
#endif
#if TRIPTYCH_HAS(1)
#define TRIPTYCH_V1(name) &name##_v1
#else
#define TRIPTYCH_V1(name) nullptr
#endif
#if TRIPTYCH_HAS(2)
#define TRIPTYCH_V2(name) &name##_v2
#else
#define TRIPTYCH_V2(name) nullptr
#endif
#if TRIPTYCH_HAS(3)
#define TRIPTYCH_V3(name) &name##_v3
#else
#define TRIPTYCH_V3(name) nullptr
#endif
// {tables of every variant}, for pick()
#define TRIPTYCH_TABLES(name) \
  { TRIPTYCH_V0(name), TRIPTYCH_V1(name), TRIPTYCH_V2(name), TRIPTYCH_V3(name) }
