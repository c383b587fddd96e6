// The paged decode attention's entry points, one table per instruction-set variant
// (kernels.cpp, compiled once per variant; op.cpp calls the table the platform chose).
#pragma once

#include <cstdint>

namespace triptych {

// Work items [i0, i1) of (sequence b, KV head h) = (item / Hkv, item % Hkv); q / out
// [B, H, D], caches [num_blocks, bs, Hkv, D], tables [B, max_blocks], lens [B] (op.cpp has
// checked every table entry a length reaches). 16-bit tensors are raw bits (bf16 / fp16).
// scratch: attention_scratch(G, D, bs) floats, the calling thread's own.
template <typename T>
using AttentionFn = void (*)(const T* q, const T* kc, const T* vc, const int32_t* tables,
                             const int32_t* lens, T* out, int64_t H, int64_t Hkv, int64_t D,
                             int64_t bs, int64_t max_blocks, float scale, int64_t i0,
                             int64_t i1, float* scratch);

struct AttentionKernels {
  AttentionFn<float> f32;
  AttentionFn<uint16_t> bf16;
  AttentionFn<uint16_t> f16;
};

// scaled queries and accumulators [G, D] each, running max and sum [G] each, scores [G, bs]
inline int64_t attention_scratch(int64_t G, int64_t D, int64_t bs) {
  return 2 * G * D + 2 * G + G * bs;
}

extern const AttentionKernels attention_v0, attention_v1, attention_v2, attention_v3;

}  // namespace triptych
