"""Paged decode attention on the CPU: the fused C++ kernel vs the torch gather + SDPA path.

    python -m triptych.bench.cpu_attention                      # OCR preset's decode shape
    python -m triptych.bench.cpu_attention --batch 1 --heads 8 --kv-heads 4 --context 2048

One layer's call, with the per-forward plan built once (as in the engine); rounds
alternate torch / fused and the medians are printed, with the K/V read rate of each
(bytes of the cached K and V the batch attends to / time). Besides wall time each call's
CPU time (all threads) is shown: on a shared, loaded box it stays close to the work done
while wall time also counts waiting for a core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch


def _time(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="sequences (one query token each)")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=164, help="mean context length (±40%%)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: policy)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=50, help="calls per round")
    args = p.parse_args(argv)

    from triptych.worker.threads import apply_thread_policy, early_env

    early_env(args.threads)
    threads = apply_thread_policy(args.threads)
    from triptych.engine.device.platform import cpu_kernels
    from triptych.kernels import torch_ref
    from triptych.kernels.cpu import paged_attention as cpu_paged_attention

    print(f"kernels: {cpu_kernels()}")  # the platform's choice for this CPU (TRIPTYCH_CPU_ISA)
    if not cpu_paged_attention.available():
        raise SystemExit("the fused CPU kernel did not build here (see the warning above)")
    dtype = getattr(torch, args.dtype)
    b, h, hkv, d, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    g = torch.Generator().manual_seed(0)
    lo, hi = max(1, int(args.context * 0.6)), max(2, int(args.context * 1.4))
    lens = torch.randint(lo, hi, (b,), generator=g, dtype=torch.int32)
    max_blocks = -(-hi // bs)
    nb = b * max_blocks * 4  # a cache 4x larger than the batch needs: blocks scattered
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[:b * max_blocks].view(b, max_blocks).int()
    q = torch.randn(b, h, d, generator=g).to(dtype)
    scale = d ** -0.5
    ref_plan = torch_ref.decode_plan(tables, lens, bs)
    cpu_plan = cpu_paged_attention.decode_plan(tables, lens, bs)
    fns = {
        "torch gather + SDPA": lambda: torch_ref.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, ref_plan),
        "fused C++": lambda: cpu_paged_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, cpu_plan),
    }
    err = (fns["fused C++"]().float() - fns["torch gather + SDPA"]().float()).abs().max()
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            fn()
            wall, used = _time(fn, args.iters)
            times[name].append(wall)
            cpu[name].append(used)
    kv_bytes = 2 * int(lens.sum()) * hkv * d * k_cache.element_size()
    print(f"batch {b}, heads {h}/{hkv}, head_dim {d}, block {bs}, mean context "
          f"{float(lens.float().mean()):.0f}, {args.dtype}, {threads} threads; "
          f"K/V read {kv_bytes / 1e6:.2f} MB; max |diff| {float(err):.2e}; "
          f"load average {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    for name, t in med.items():
        print(f"  {name:<20} wall {1e6 * t:8.1f} us ({kv_bytes / t / 1e9:5.1f} GB/s of K/V), "
              f"CPU {1e6 * med_cpu[name]:8.1f} us; rounds (wall): "
              + ", ".join(f"{1e6 * x:.0f}" for x in times[name]))
    a, b = "torch gather + SDPA", "fused C++"
    print(f"  speed-up: wall {med[a] / med[b]:.2f}x, CPU time {med_cpu[a] / med_cpu[b]:.2f}x")


if __name__ == "__main__":
    main()
