// The fused layer ops' entry points, one table per instruction-set variant (kernels.cpp,
// compiled once per variant; op.cpp calls the table the platform chose). All fp32.
#pragma once

#include <cstdint>

namespace triptych {

struct FusedKernels {
  // rows [t0, t1): s = x + r (r may be null: s = x), y = s * rsqrt(mean(s^2) + eps) * w;
  // x / r rows xs / rs apart, y rows C apart; sum (when r is given) receives s, rows C apart
  void (*rms_rows)(const float* x, int64_t xs, const float* r, int64_t rs, const float* w,
                   float* y, float* sum, int64_t C, float eps, int64_t t0, int64_t t1);
  // out[t, h] = x[t, h] * cos[t] + roll(x[t, h], D/2) * sin[t] (rotate-half signs are in
  // sin, torch_ref.mrope_plan's rows), separate roundings: torch's bits. x rows ts apart,
  // heads hs apart; out contiguous [T, H, D]
  void (*rope)(const float* x, int64_t ts, int64_t hs, float* out, const float* cos,
               const float* sin, int64_t T, int64_t H, int64_t D);
  // rows [t0, t1) of out [T, I] = silu(gate) * up, gate_up rows rs apart (gate | up)
  void (*silu_mul_rows)(const float* gate_up, int64_t rs, int64_t inter, float* out,
                        int64_t t0, int64_t t1);
};

extern const FusedKernels fused_v0, fused_v1, fused_v2, fused_v3;

}  // namespace triptych
