// Paged decode attention for the CPU as a torch op: one query token per sequence, K/V read
// in place from their cache blocks through the block table. Registered as
// torch.ops.triptych_cpu.{paged_decode_attention, variants}; built on first use by
// kernels/cpu/build.py with one copy of kernels.cpp per instruction-set variant; the call
// names the variant (kernels/cpu/isa.py, chosen by engine/device/platform.py).
//
//   q:            [B, H, D]                     fp32 / bf16 / fp16, rows contiguous
//   k/v_cache:    [num_blocks, bs, Hkv, D]      same dtype as q, contiguous
//   block_tables: [B, max_blocks] int32;  seq_lens: [B] int32 (context incl. the query)
//   out:          [B, H, D]                     dtype of q
//
// Work items (sequence, KV head) run on torch's intra-op threads (at::parallel_for);
// `grain` items per thread at least (the Python wrapper sizes it so a thread wake-up pays
// for itself). Every table entry a length reaches is checked here, before any thread reads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../variants.h"
#include "kernels.h"

namespace {

using triptych::AttentionKernels;

const AttentionKernels* const kTables[triptych::kVariants] = TRIPTYCH_TABLES(triptych::attention);

std::vector<int64_t> variants() { return triptych::built_variants(); }

template <typename T>
void run(triptych::AttentionFn<T> fn, const at::Tensor& q, const at::Tensor& kc,
         const at::Tensor& vc, const int32_t* tables, const int32_t* lens, at::Tensor& out,
         int64_t Hkv, int64_t bs, int64_t mb, float scale, int64_t grain) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), G = H / Hkv;
  const auto* qp = static_cast<const T*>(q.data_ptr());
  const auto* kp = static_cast<const T*>(kc.data_ptr());
  const auto* vp = static_cast<const T*>(vc.data_ptr());
  auto* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(triptych::attention_scratch(G, D, bs));  // this thread's
    fn(qp, kp, vp, tables, lens, op, H, Hkv, D, bs, mb, scale, begin, end, scratch.data());
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t grain,
                                  int64_t variant) {
  const AttentionKernels& kern = triptych::pick(kTables, variant, "paged_decode_attention");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, H, D], k_cache [N, bs, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention needs contiguous tensors");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the KV cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes() && H % Hkv == 0,
              "shape mismatch between q and the KV cache");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "one table row per sequence");
  at::Tensor out = at::empty_like(q);
  if (B == 0) return out;
  const int64_t mb = block_tables.size(1), nb = k_cache.size(0);
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] <= mb * bs, "seq_lens[", b, "] = ", lens[b], " exceeds its block table");
    for (int64_t j = 0; j * bs < lens[b]; ++j)
      TORCH_CHECK(tables[b * mb + j] >= 0 && tables[b * mb + j] < nb, "block id ",
                  tables[b * mb + j], " out of range");
  }
  const float sc = static_cast<float>(scale);
  const int64_t gr = std::max<int64_t>(grain, 1);
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(kern.f32, q, k_cache, v_cache, tables, lens, out, Hkv, bs, mb, sc, gr);
      break;
    case at::kBFloat16:
      run<uint16_t>(kern.bf16, q, k_cache, v_cache, tables, lens, out, Hkv, bs, mb, sc, gr);
      break;
    case at::kHalf:
      run<uint16_t>(kern.f16, q, k_cache, v_cache, tables, lens, out, Hkv, bs, mb, sc, gr);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: fp32, bf16 or fp16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(triptych_cpu, m) {
  m.def("variants() -> int[]", &variants);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int grain, int variant) -> Tensor");
}

TORCH_LIBRARY_IMPL(triptych_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
