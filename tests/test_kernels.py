"""Triton kernels equal their torch references (run under TRITON_INTERPRET=1 on CPU),
and the torch references equal dense attention on gathered K/V.

The interpreter is ~1000x slower than torch: sizes are tiny but cover GQA 1 and 4,
lengths on and off block boundaries, length-1 sequences, shuffled block tables, chunks
with and without cached prefix, the split-K path, and bf16 through the fp32 upcast.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from triptych.kernels import resolve_backend, torch_ref

import triton  # noqa: E402, F401 (the [triton] extra, which the README installs)
assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets the interpreter first"
from triptych.kernels.triton import ops as triton_ops  # noqa: E402  (after the interpreter check)
from triptych.kernels.triton.decode_attention import (  # noqa: E402
    MAX_PARTITION,
    choose_partition,
    choose_splits,
    decode_block_n,
    partition_for,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def paged_setup(lens: list[int], hkv: int, d: int, bs: int, dtype: torch.dtype, seed: int = 0):
    """Random caches and a shuffled (non-contiguous) block table covering ``lens``."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // bs) for n in lens]
    nb = sum(nblk) + 5
    k = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    i = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[i:i + n]
        i += n
    return k, v, bt, torch.tensor(lens, dtype=torch.int32)


def dense_reference(q, k_cache, v_cache, bt, lens, q_lens, scale):
    """Gather each sequence's K/V and run plain causal SDPA with GQA expanded."""
    outs, s = [], 0
    h, hkv = q.shape[1], k_cache.shape[2]
    for i, (n, ql) in enumerate(zip(lens.tolist(), q_lens)):
        nblk = -(-n // k_cache.shape[1])
        k = k_cache[bt[i, :nblk].long()].flatten(0, 1)[:n].float()
        v = v_cache[bt[i, :nblk].long()].flatten(0, 1)[:n].float()
        k, v = (x.repeat_interleave(h // hkv, 1).transpose(0, 1) for x in (k, v))
        qi = q[s:s + ql].float().transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        outs.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
                    .transpose(0, 1))
        s += ql
    return torch.cat(outs)


@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_attention(h, hkv, dtype):
    lens = [1, 7, 8, 21]
    k, v, bt, sl = paged_setup(lens, hkv, 16, 4, dtype)
    q = torch.randn(len(lens), h, 16).to(dtype)
    ref = torch_ref.paged_decode_attention(q, k, v, bt, sl, 0.25)
    close(triton_ops.paged_decode_attention(q, k, v, bt, sl, 0.25), ref, dtype)
    # Split-K: partitions of 16 tokens give the 21-token sequence two splits.
    close(triton_ops.paged_decode_attention(q, k, v, bt, sl, 0.25, partition_size=16), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_many_splits(dtype):
    """19 partitions of 16 tokens: the reduce kernel merges them in two S_BLOCK chunks; the
    shorter sequence's trailing splits are skipped by both kernels."""
    k, v, bt, sl = paged_setup([300, 37], 2, 32, 16, dtype, seed=3)
    q = torch.randn(2, 4, 32).to(dtype)
    ref = torch_ref.paged_decode_attention(q, k, v, bt, sl, 32 ** -0.5)
    close(triton_ops.paged_decode_attention(q, k, v, bt, sl, 32 ** -0.5, partition_size=16),
          ref, dtype)


def test_split_rule():
    """The split count follows the shape (H100: 132 SMs, 64-token tiles): programs (batch x
    KV heads x splits) fill the device about three times over where the context allows,
    no split is shorter than a tile or longer than MAX_PARTITION; the issue's case (batch
    1, 2 KV heads, 4K context) now launches 128 programs, not 64."""
    sms, bn = 132, 64
    for b in (1, 8, 64, 256):
        for hkv in (2, 8):
            for ctx in (100, 512, 4096, 32768):
                splits = choose_splits(b, hkv, ctx, bn, sms)
                p = partition_for(ctx, splits, bn)
                assert p % bn == 0 and bn <= p and -(-ctx // p) <= splits
                assert p <= MAX_PARTITION or splits == -(-ctx // MAX_PARTITION)
                # enough programs, unless that would cut splits below one tile
                assert b * hkv * splits >= 3 * sms or splits == -(-ctx // bn) \
                    or splits == -(-ctx // MAX_PARTITION)
    assert choose_splits(1, 2, 4096, bn, sms) * 2 == 128
    assert choose_splits(1, 2, 32768, bn, sms) * 2 >= 3 * sms  # 32K: the device is full
    assert choose_partition(1, 8, 100, bn, sms) >= 100 or choose_splits(1, 8, 100, bn, sms) > 1
    assert choose_partition(256, 8, 32768, bn, sms) == MAX_PARTITION


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_fixed_splits_for_graphs(dtype):
    """A CUDA graph's launch: splits fixed by the batch size and the partition read from
    device memory. One launch shape serves contexts 17 and 300 alike, and a padding row of
    length 0 gives zeros (no NaN) and leaves the real rows as they are."""
    k, v, bt, sl = paged_setup([300, 17, 1], 2, 32, 16, dtype, seed=5)
    q = torch.randn(3, 4, 32).to(dtype)
    ref = torch_ref.paged_decode_attention(q, k, v, bt, sl, 32 ** -0.5)
    bn = decode_block_n(dtype, 32)
    for splits in (1, 3, 8):
        part = torch.tensor([partition_for(int(sl.max()), splits, bn)], dtype=torch.int32)
        got = triton_ops.paged_decode_attention(q, k, v, bt, sl, 32 ** -0.5,
                                                num_splits=splits, partition=part)
        close(got, ref, dtype)
    padded = sl.clone()
    padded[2] = 0  # a padding row
    for splits in (1, 3):
        part = torch.tensor([partition_for(300, splits, bn)], dtype=torch.int32)
        got = triton_ops.paged_decode_attention(q, k, v, bt, padded, 32 ** -0.5,
                                                num_splits=splits, partition=part)
        assert torch.isfinite(got.float()).all() and not got[2].float().abs().any()
        close(got[:2], ref[:2], dtype)


@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_attention(h, hkv, dtype):
    # (context len, chunk len): fresh prompt, chunk after a cached prefix, a decode row,
    # and a chunk not aligned to the block size.
    spec = [(9, 9), (23, 6), (12, 1), (19, 18)]
    lens = [n for n, _ in spec]
    q_lens = [c for _, c in spec]
    k, v, bt, sl = paged_setup(lens, hkv, 16, 4, dtype, seed=1)
    q = torch.randn(sum(q_lens), h, 16).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    ref = torch_ref.paged_prefill_attention(q, k, v, bt, cu, sl, 0.25)
    close(triton_ops.paged_prefill_attention(q, k, v, bt, cu, sl, 0.25), ref, dtype)


def test_torch_reference_equals_dense_sdpa():
    spec = [(9, 9), (23, 6), (12, 1), (19, 18)]
    lens = [n for n, _ in spec]
    q_lens = [c for _, c in spec]
    k, v, bt, sl = paged_setup(lens, 2, 16, 4, torch.float32, seed=2)
    q = torch.randn(sum(q_lens), 8, 16)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    dense = dense_reference(q, k, v, bt, sl, q_lens, 0.25)
    close(torch_ref.paged_prefill_attention(q, k, v, bt, cu, sl, 0.25), dense, torch.float32)
    qd = torch.randn(4, 8, 16)
    dense_d = dense_reference(qd, k, v, bt, sl, [1] * 4, 0.25)
    close(torch_ref.paged_decode_attention(qd, k, v, bt, sl, 0.25), dense_d, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache(dtype):
    k_cache = torch.randn(6, 4, 2, 16).to(dtype)
    v_cache = torch.randn(6, 4, 2, 16).to(dtype)
    # key/value as strided views of one fused qkv projection, as the model passes them
    qkv = torch.randn(5, 8, 16).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, -1, 17, 22, 8])
    a = (k_cache.clone(), v_cache.clone())
    b = (k_cache.clone(), v_cache.clone())
    torch_ref.reshape_and_cache(key, value, *a, slots)
    triton_ops.reshape_and_cache(key, value, *b, slots)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_varlen_attention(dtype):
    cu = torch.tensor([0, 1, 17, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, 2, 16).to(dtype) for _ in range(3))
    close(triton_ops.varlen_attention(q, k, v, cu, 0.25),
          torch_ref.varlen_attention(q, k, v, cu, 0.25), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm(dtype):
    x, r = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype)
    w = torch.randn(48).to(dtype)
    close(triton_ops.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6), dtype)
    (a, ra), (b, rb) = triton_ops.rms_norm(x, w, 1e-6, r), torch_ref.rms_norm(x, w, 1e-6, r)
    close(a, b, dtype)
    close(ra, rb, dtype)
    x3 = torch.randn(2, 3, 48).to(dtype)  # leading dims are flattened
    close(triton_ops.rms_norm(x3, w, 1e-6), torch_ref.rms_norm(x3, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mrope(dtype):
    d = 16
    inv = 1.0 / (100 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(64).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    pos = torch.randint(0, 64, (3, 7))
    qkv = torch.randn(7, 8, d).to(dtype)
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided views, as the model passes them
    qa, ka = triton_ops.apply_mrope(q, k, pos, cache, [2, 3, 3])
    qb, kb = torch_ref.apply_mrope(q, k, pos, cache, [2, 3, 3])
    close(qa, qb, dtype)
    close(ka, kb, dtype)


def test_wrappers_reject_bad_arguments(monkeypatch):
    """Checks run before launch and raise ValueError (they survive python -O)."""
    k, v, bt, sl = paged_setup([5], 2, 16, 4, torch.float32)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="q is torch.float16 but the cache"):
        triton_ops.paged_decode_attention(q.half(), k, v, bt, sl, 0.25)
    with pytest.raises(ValueError, match="does not fit cache"):
        triton_ops.paged_decode_attention(torch.randn(1, 3, 16), k, v, bt, sl, 0.25)
    with pytest.raises(ValueError, match="int32/int64"):
        triton_ops.paged_decode_attention(q, k, v, bt.float(), sl, 0.25)
    with pytest.raises(ValueError, match="partition_size"):
        triton_ops.paged_decode_attention(q, k, v, bt, sl, 0.25, partition_size=24)
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.reshape_and_cache(q[:, :2], q[:, :2], k.transpose(1, 2), v.transpose(1, 2),
                                     torch.tensor([0]))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_ops.rms_norm(q[0], torch.ones(16), 1e-6)


def test_backend_resolution(monkeypatch):
    from triptych.kernels.cpu import paged_attention as cpu_paged_attention

    cpu_default = "cpu" if cpu_paged_attention.available() else "torch"  # C++ kernel built?
    assert resolve_backend(None, "cpu") == cpu_default
    assert resolve_backend(None, "cuda") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flash", "cpu")


def test_engine_outputs_equal_across_backends(tiny_qwen2_vl):
    """Greedy tokens unchanged when the engine's kernels switch from torch to Triton (here
    under the interpreter) or to the fused CPU decode: paged prefill, decode, KV writes,
    vision attention, norms, rope."""
    import numpy as np
    from PIL import Image

    from triptych import LLM, SamplingParams

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    conv = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "What is it?"}]}]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    outs = {}
    from triptych.kernels.cpu import paged_attention as cpu_paged_attention

    backends = ("torch", "triton") + (("cpu",) if cpu_paged_attention.available() else ())
    for backend in backends:
        llm = LLM(tiny_qwen2_vl, block_size=4, attention_backend=backend,
                  max_num_batched_tokens=16)  # chunked: prefill with a cached prefix too
        (outs[backend],) = llm.chat(conv, sp, use_tqdm=False)
        assert llm.engine.attention_backend == backend
    a = outs["torch"].outputs[0]
    for backend in backends[1:]:
        b = outs[backend].outputs[0]
        assert a.token_ids == b.token_ids, backend
        for x, y in zip(a.logprobs, b.logprobs):
            for tok in x:
                assert abs(x[tok].logprob - y[tok].logprob) < 1e-4, backend


def test_kernels_compile_for_h100():
    """No GPU here, but Triton's CUDA backend compiles to sm_90 cubin without one: every
    kernel, in bf16 / fp16 / fp32, passes the real compiler (layouts, dot shapes, dtypes)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-m", "triptych.kernels.triton.compile_check", "--arch", "90"],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == 27 and "0 failed" in r.stdout  # 9 launches x 3 dtypes


# ---------------------------------------------------------------- per-forward plans (torch)

def test_plans_equal_unplanned_calls():
    """A plan built once per forward (as the model does) gives the same result as each op
    building its own, for decode, grouped prefill (equal shapes batched, mixed shapes,
    a cached prefix, a decode row), KV writes with padding and M-RoPE."""
    spec = [(9, 9), (9, 9), (23, 6), (12, 1), (12, 1), (19, 18)]
    lens, q_lens = [n for n, _ in spec], [c for _, c in spec]
    k, v, bt, sl = paged_setup(lens, 2, 16, 4, torch.float32, seed=3)
    q = torch.randn(sum(q_lens), 8, 16)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    plan = torch_ref.prefill_plan(bt, cu, sl, 4, cu.numpy(), sl.numpy())
    assert sorted((g.q_len, g.seq_len) for g in plan) == [(1, 12), (6, 23), (9, 9), (18, 19)]
    got = torch_ref.paged_prefill_attention(q, k, v, bt, cu, sl, 0.25, plan=plan)
    close(got, dense_reference(q, k, v, bt, sl, q_lens, 0.25), torch.float32)
    qd = torch.randn(len(lens), 8, 16)
    dplan = torch_ref.decode_plan(bt, sl, 4)
    assert torch.equal(torch_ref.paged_decode_attention(qd, k, v, bt, sl, 0.25, plan=dplan),
                       torch_ref.paged_decode_attention(qd, k, v, bt, sl, 0.25))
    slots = torch.tensor([3, -1, 17])
    kv = torch.randn(3, 2, 16)
    a, b = k.clone(), k.clone()
    torch_ref.reshape_and_cache(kv, kv, a, a.clone(), slots, plan=torch_ref.cache_plan(slots))
    torch_ref.reshape_and_cache(kv, kv, b, b.clone(), slots)
    assert torch.equal(a, b)


def test_fp32_fast_paths_are_bit_exact():
    """rms_norm (torch's fused op) and M-RoPE (roll form) equal the step-by-step HF math."""
    x, r, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    h = x + r
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    y, res = torch_ref.rms_norm(x, w, 1e-6, r)
    assert torch.equal(y, ref) and torch.equal(res, h)
    d = 16
    ang = torch.arange(64).float()[:, None] * (1.0 / (100 ** (torch.arange(0, d, 2).float() / d)))
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    pos = torch.randint(0, 64, (3, 7))
    q, k = torch.randn(7, 4, d), torch.randn(7, 2, d)
    sec = torch.repeat_interleave(torch.arange(3), torch.tensor([2, 3, 3]))
    cs = cache[pos]  # [3, T, D]: HF's per-section selection, then cos|cos and sin|sin
    cos = torch.gather(cs[..., :d // 2], 0, sec.expand(1, 7, -1))[0]
    sin = torch.gather(cs[..., d // 2:], 0, sec.expand(1, 7, -1))[0]
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)

    qa, ka = torch_ref.apply_mrope(q, k, pos, cache, [2, 3, 3])
    assert torch.equal(qa, q * cos + rotate_half(q) * sin)
    assert torch.equal(ka, k * cos + rotate_half(k) * sin)


def test_varlen_attention_batches_equal_segments():
    cu = torch.tensor([0, 16, 32, 48, 57, 73], dtype=torch.int32)  # 3 equal, 1 odd, 1 equal
    q, k, v = (torch.randn(73, 2, 16) for _ in range(3))
    got = torch_ref.varlen_attention(q, k, v, cu, 0.25)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)),
                                             scale=0.25).transpose(0, 1)
        close(got[s:e], ref, torch.float32)
