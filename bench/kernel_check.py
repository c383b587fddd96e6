"""Every Triton kernel against its torch reference on the device it runs on (`bench gpu`,
step kernels): paged decode (GQA 1-8 including 6, head dims 64/80/128, one split and
split-K, lengths 1 to 4,096), paged prefill after a cached prefix, varlen vision
attention, the KV cache write (with padding slots), RMSNorm with and without a residual
and M-RoPE, in bf16 / fp16 / fp32.

    python -m triptych.bench.kernel_check            # CUDA: the served shapes
    python -m triptych.bench.kernel_check --smoke    # CPU: tiny shapes, TRITON_INTERPRET=1

tests/test_kernels.py holds the same contracts on the CPU (under the interpreter, tiny
sizes); this runs them where the compiled kernels run, at the sizes they are served at.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}


def _paged(lens: list[int], hkv: int, d: int, bs: int, dtype: Any, dev: str, gen: Any
           ) -> tuple[Any, Any, Any, Any]:
    """Random caches and a shuffled block table covering ``lens`` (+ spare blocks)."""
    import torch

    nblk = [-(-n // bs) for n in lens]
    nb = sum(nblk) + 3
    k = torch.randn(nb, bs, hkv, d, generator=gen, device=dev).to(dtype)
    v = torch.randn(nb, bs, hkv, d, generator=gen, device=dev).to(dtype)
    perm = torch.randperm(nb, generator=gen, device=dev).to(torch.int32)
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=dev)
    i = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[i:i + n]
        i += n
    return k, v, bt, torch.tensor(lens, dtype=torch.int32, device=dev)


def cases(smoke: bool, dev: str) -> Iterator[tuple[str, Callable[[], tuple[Any, Any]]]]:
    """(name, run) pairs; run() returns (triton output, reference output)."""
    import torch
    from triptych.kernels import torch_ref as ref
    from triptych.kernels.triton import ops as tri

    gen = torch.Generator(device=dev).manual_seed(0)
    # (heads, kv heads, head dim): GQA 6 at 128 (Qwen2-VL-2B), 1 at 64, 8 at 80, 4 at 128;
    # every shape in the served dtype, the served shape in fp32 (parity) and fp16: each
    # (shape, dtype) is ~7 compiles, 0.5-1.5 s each on a cold box (the step's budget)
    shapes = [(12, 2, 128), (8, 8, 64), (16, 2, 80), (32, 8, 128)]
    heads_of = ({"float32": [(4, 2, 16)], "bfloat16": [(4, 2, 16)]} if smoke else
                {"bfloat16": shapes, "float32": shapes[:1], "float16": shapes[:1]})
    bs = 4 if smoke else 16
    dec_lens = [1, 9, 23] if smoke else [1, 17, 300, 4096]
    spec = [(9, 9), (13, 4), (6, 1)] if smoke else [(300, 300), (1000, 64), (17, 1), (77, 76)]
    segs = [0, 1, 17, 40] if smoke else [0, 7, 1031, 2055, 3079]
    # the host's longest context, chunk and segment, passed as the engine passes them
    max_len, max_q = max(dec_lens), max(c for _, c in spec)
    longest = max(b - a for a, b in itertools.pairwise(segs))

    def randn(*shape: int, dt: Any) -> Any:
        return torch.randn(*shape, generator=gen, device=dev).to(dt)

    for name, heads in heads_of.items():
        dt = getattr(torch, name)
        for h, hkv, d in heads:
            k, v, bt, sl = _paged(dec_lens, hkv, d, bs, dt, dev, gen)
            q = randn(len(dec_lens), h, d, dt=dt)
            args = (q, k, v, bt, sl, d ** -0.5)
            yield (f"decode {name} {h}/{hkv}x{d}",
                   lambda a=args: (tri.paged_decode_attention(*a, max_seq_len=max_len),
                                   ref.paged_decode_attention(*a)))
            yield (f"decode split-K {name} {h}/{hkv}x{d}",
                   lambda a=args: (tri.paged_decode_attention(
                       *a, max_seq_len=max_len, partition_size=16 if smoke else 64),
                       ref.paged_decode_attention(*a)))
            lens, q_lens = [n for n, _ in spec], [c for _, c in spec]
            k, v, bt, sl = _paged(lens, hkv, d, bs, dt, dev, gen)
            qp = randn(sum(q_lens), h, d, dt=dt)
            cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                              device=dev)
            args = (qp, k, v, bt, cu, sl, d ** -0.5)
            yield (f"prefill (cached prefix) {name} {h}/{hkv}x{d}",
                   lambda a=args: (tri.paged_prefill_attention(
                       *a, max_query_len=max_q), ref.paged_prefill_attention(*a)))
        vh, vd = (2, 16) if smoke else (16, 80)  # the 2B tower's heads
        cu = torch.tensor(segs, dtype=torch.int32, device=dev)
        qkv = [randn(segs[-1], vh, vd, dt=dt) for _ in range(3)]
        yield (f"varlen {name} {vh}x{vd}",
               lambda a=(*qkv, cu, vd ** -0.5): (tri.varlen_attention(*a, max_seqlen=longest),
                                                 ref.varlen_attention(*a)))
        yield f"kv write {name}", lambda dt=dt: _kv_write(tri, ref, randn, dt, dev, smoke)
        n = 48 if smoke else 1536
        x, r, w = randn(5, n, dt=dt), randn(5, n, dt=dt), randn(n, dt=dt)
        yield (f"rms_norm {name}",
               lambda a=(x, w, 1e-6): (tri.rms_norm(*a), ref.rms_norm(*a)))
        yield (f"rms_norm + residual {name}",
               lambda a=(x, w, 1e-6, r): (torch.cat(tri.rms_norm(*a)),
                                          torch.cat(ref.rms_norm(*a))))
        yield f"mrope {name}", lambda dt=dt: _mrope(tri, ref, randn, dt, dev, smoke)


def _kv_write(tri: Any, ref: Any, randn: Any, dt: Any, dev: str, smoke: bool) -> tuple[Any, Any]:
    """Both writes from strided views of one qkv projection, one padding slot (-1)."""
    import torch

    nb, bs, hkv, d = (6, 4, 2, 16) if smoke else (64, 16, 2, 128)
    cache = randn(2, nb, bs, hkv, d, dt=dt)
    qkv = randn(5, 4 + 2 * hkv, d, dt=dt)
    key, value = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    slots = torch.tensor([3, -1, 17, 22, 8], device=dev)
    a, b = cache.clone(), cache.clone()
    tri.reshape_and_cache(key, value, a[0], a[1], slots)
    ref.reshape_and_cache(key, value, b[0], b[1], slots)
    return a, b


def _mrope(tri: Any, ref: Any, randn: Any, dt: Any, dev: str, smoke: bool) -> tuple[Any, Any]:
    import torch

    d, t = (16, 7) if smoke else (128, 300)
    sec = [2, 3, 3] if smoke else [16, 24, 24]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    pos = torch.randint(0, 4096, (3, t), device=dev)
    qkv = randn(t, 16, d, dt=dt)
    q, k = qkv[:, :12], qkv[:, 12:14]  # strided views, as the model passes them
    return (torch.cat([x.flatten() for x in tri.apply_mrope(q, k, pos, cache, sec)]),
            torch.cat([x.flatten() for x in ref.apply_mrope(q, k, pos, cache, sec)]))


def check(smoke: bool) -> dict[str, Any]:
    """Run every case; each records its max abs error and whether it is within tolerance."""
    import torch

    dev = "cpu" if smoke else "cuda"
    rows = []
    for name, run in cases(smoke, dev):
        tol = TOL[next(t for t in TOL if f" {t}" in name)]
        try:
            got, want = run()
            err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
            ok = bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))
            rows.append({"case": name, "max_abs_err": err, "tol": tol, "ok": ok})
        except Exception as e:  # noqa: BLE001 - a case that raises fails alone
            rows.append({"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
        print(f"{'ok ' if rows[-1]['ok'] else 'BAD'} {name}"
              + (f"  max err {rows[-1]['max_abs_err']:.2e}" if "max_abs_err" in rows[-1]
                 else f"  {rows[-1]['error']}"), flush=True)
    passed = sum(r["ok"] for r in rows)
    return {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
            "passed": passed, "total": len(rows), "ok": passed == len(rows), "cases": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the interpreter")
    ap.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    res = check(args.smoke)
    print(f"{res['passed']}/{res['total']} cases equal their torch reference on {res['device']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
