"""Time each Triton kernel against its torch reference and the memory-bandwidth floor.

    python -m triptych.bench.kernels                  # on a CUDA GPU (7B-like decode shapes)
    python -m triptych.bench.kernels --heads 12,2     # Qwen2-VL-2B's 12 heads / 2 KV heads
    python -m triptych.bench.kernels --smoke          # CPU: tiny shapes under TRITON_INTERPRET=1

No host sync inside a timed region: every call gets the lengths the host knows (max
context, max query length, host cu_seqlens), as the engine passes them, and the torch
references their per-forward plans made beforehand (the engine makes one per forward for
all layers); ``reps`` calls are launched back to back between two CUDA events and the
device is synchronised once, after the last.

The floor of a memory-bound kernel is (bytes it must move) / (measured device copy
bandwidth, counting bytes read + written by a large `copy_`). Paged decode must read every
cached K and V of every sequence once, so at 7B shapes (32 heads, 8 KV heads, head_dim 128,
bf16) its bytes are 2 * batch * context * 8 * 128 * 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the interpreter")
    ap.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    ap.add_argument("--contexts", default="512,4096,32768", help="decode context lengths")
    ap.add_argument("--heads", default="32,8", help="query heads,KV heads (GPU shapes)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (GPU shapes)")
    ap.add_argument("--json-out", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (use --smoke for a CPU interpreter run)")
        return 0
    from triptych.kernels import torch_ref
    from triptych.kernels.triton import ops as triton_ops
    from triptych.kernels.triton.common import num_sms, pad_dim
    from triptych.kernels.triton.decode_attention import _config, choose_partition

    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    heads = [int(x) for x in args.heads.split(",")]
    h, hkv, d, bs = (4, 2, 16, 4) if args.smoke else (heads[0], heads[1], args.head_dim, 16)
    batches = [2] if args.smoke else [int(x) for x in args.batches.split(",")]
    contexts = [20] if args.smoke else [int(x) for x in args.contexts.split(",")]

    def timeit(fn, reps: int = 1 if args.smoke else 20) -> float:
        """Seconds per call: ``reps`` calls back to back after warm-up (compiles first)."""
        for _ in range(1 if args.smoke else 3):
            fn()
        if dev != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / reps

    n = (1 << 20) if args.smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * n / timeit(lambda: dst.copy_(src))
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (interpreter)'}")
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.1f} GB/s\n")
    rows = []
    print(f"{'kernel':<16}{'batch':>6}{'ctx':>7}{'splits':>7}{'triton us':>11}{'torch us':>10}"
          f"{'GB/s':>8}{'% floor':>9}")
    for b in batches:
        for ctx in contexts:
            kv_bytes = 2 * b * ctx * hkv * d * torch.tensor([], dtype=dtype).element_size()
            if kv_bytes > (40 << 30):
                continue
            nblk = -(-ctx // bs)
            k = torch.randn(b * nblk, bs, hkv, d, device=dev, dtype=dtype)
            v = torch.randn_like(k)
            bt = torch.randperm(b * nblk, device=dev, dtype=torch.int32).view(b, nblk)
            sl = torch.full((b,), ctx, device=dev, dtype=torch.int32)
            q = torch.randn(b, h, d, device=dev, dtype=dtype)
            # The split count the wrapper will choose for this shape (printed, not forced).
            part = choose_partition(b, hkv, ctx, _config(q, pad_dim(d))[0], num_sms(q.device))
            splits = -(-ctx // part)
            args_ = (q, k, v, bt, sl, d ** -0.5)
            t_tri = timeit(lambda a=args_, n=ctx: triton_ops.paged_decode_attention(
                *a, max_seq_len=n))
            # The reference gathers a copy of K/V: skip it where that copy would not fit.
            t_ref = float("nan")
            if kv_bytes < (8 << 30):
                plan = torch_ref.decode_plan(bt, sl, bs, max_seq_len=ctx)
                t_ref = timeit(lambda a=args_, p=plan: torch_ref.paged_decode_attention(*a, p))
            floor = kv_bytes / copy_bw
            row = ("decode", b, ctx, t_tri * 1e6, t_ref * 1e6, kv_bytes / t_tri / 1e9,
                   100 * floor / t_tri)
            rows.append(row)
            print(f"{row[0]:<16}{b:>6}{ctx:>7}{splits:>7}{row[3]:>11.1f}{row[4]:>10.1f}"
                  f"{row[5]:>8.0f}{row[6]:>8.0f}%")
            del k, v, args_
    # Prefill, KV write, vision attention, norm, rope: one typical shape each, vs torch.
    t = 64 if args.smoke else 8192
    ql = 16 if args.smoke else 2048
    nseq = t // ql
    nblk = -(-ql // bs)
    k = torch.randn(nseq * nblk, bs, hkv, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    bt = torch.arange(nseq * nblk, device=dev, dtype=torch.int32).view(nseq, nblk)
    sl = torch.full((nseq,), ql, device=dev, dtype=torch.int32)
    cu = torch.arange(0, t + 1, ql, device=dev, dtype=torch.int32)
    q = torch.randn(t, h, d, device=dev, dtype=dtype)
    slots = torch.arange(t, device=dev)
    cu_cpu = cu.cpu()
    p_plan = torch_ref.prefill_plan(bt, cu, sl, bs, cu_cpu=cu_cpu, lens_cpu=sl.cpu())
    c_plan = torch_ref.cache_plan(slots, padded=False)
    extra = [
        ("prefill", lambda: triton_ops.paged_prefill_attention(q, k, v, bt, cu, sl, d ** -0.5,
                                                               max_query_len=ql),
         lambda: torch_ref.paged_prefill_attention(q, k, v, bt, cu, sl, d ** -0.5, p_plan), None),
        ("reshape_cache",
         lambda: triton_ops.reshape_and_cache(q[:, :hkv], q[:, :hkv], k, v, slots),
         lambda: torch_ref.reshape_and_cache(q[:, :hkv], q[:, :hkv], k, v, slots, c_plan),
         4 * t * hkv * d * q.element_size()),
        ("varlen_vision", lambda: triton_ops.varlen_attention(q, q, q, cu, d ** -0.5,
                                                              max_seqlen=ql),
         lambda: torch_ref.varlen_attention(q, q, q, cu, d ** -0.5, cu_seqlens_cpu=cu_cpu), None),
    ]
    x = torch.randn(t, h * d, device=dev, dtype=dtype)
    w = torch.randn(h * d, device=dev, dtype=dtype)
    extra.append(("rms_norm", lambda: triton_ops.rms_norm(x, w, 1e-6, x),
                  lambda: torch_ref.rms_norm(x, w, 1e-6, x), 4 * x.numel() * x.element_size()))
    pos = torch.randint(0, 4096, (3, t), device=dev)
    ang = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] * torch.rand(
        d // 2, device=dev)[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    kr = q[:, :hkv].contiguous()
    sec = [d // 8, 3 * d // 16, 3 * d // 16]  # Qwen2-VL's [16, 24, 24] at head_dim 128
    r_plan = torch_ref.mrope_plan(pos, cos_sin, sec)
    extra.append(("mrope", lambda: triton_ops.apply_mrope(q, kr, pos, cos_sin, sec),
                  lambda: torch_ref.apply_mrope(q, kr, pos, cos_sin, sec, r_plan),
                  2 * (q.numel() + kr.numel()) * q.element_size()))
    for name, tri, ref, nbytes in extra:
        t_tri, t_ref = timeit(tri), timeit(ref)
        gbs = nbytes / t_tri / 1e9 if nbytes else float("nan")
        pct = 100 * nbytes / copy_bw / t_tri if nbytes else float("nan")
        rows.append((name, nseq, ql, t_tri * 1e6, t_ref * 1e6, gbs, pct))
        print(f"{name:<16}{nseq:>6}{ql:>7}{'':>7}{t_tri * 1e6:>11.1f}{t_ref * 1e6:>10.1f}"
              + (f"{gbs:>8.0f}{pct:>8.0f}%" if nbytes else f"{'-':>8}{'-':>9}"))
    print("\nsummary (memory-bound kernels: % of the copy-bandwidth floor; all: speed-up "
          "over the torch reference)")
    print(f"  {'kernel':<14} {'batch':>5} {'ctx/len':>7} {'% floor':>8} {'vs torch':>9}")
    for r in rows:
        floor = "-" if r[6] != r[6] else f"{r[6]:.0f}%"  # NaN: no byte floor (compute-bound)
        print(f"  {r[0]:<14} {r[1]:>5} {r[2]:>7} {floor:>8} {r[4] / r[3]:>8.2f}x")
    if args.json_out:
        import json
        import math

        keys = ("kernel", "batch", "ctx", "triton_us", "torch_us", "gb_s", "pct_floor")
        with open(args.json_out, "w") as f:  # NaN (no floor, no reference) as null
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                       "heads": [h, hkv, d], "copy_gb_s": copy_bw / 1e9,
                       "rows": [{k: None if isinstance(v, float) and math.isnan(v) else v
                                 for k, v in zip(keys, r, strict=True)}
                                for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
