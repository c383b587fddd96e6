"""Attention per phase (kernels/choice.py): a prefill step in which no row has a cached
prefix attends over its fresh q/k/v (SDPA by runs of equal lengths, or varlen_attn on a
GPU) and equals the paged path; a step with a cached prefix still takes the paged kernel;
the vision tower's varlen attention equals the reference at head dims 72/80; the choice is
one line at start-up.

On the CPU the SDPA path runs for real and ``varlen_attn`` (CUDA only) is checked through
a stand-in with torch 2.11's and 2.13's signatures. The CUDA tests (skipped elsewhere, run
them with ``pytest tests/test_attention_phases.py`` on a GPU) run varlen_attn, SDPA under
the flash-first priority (no cuDNN) and the Triton paged prefill's short-chunk tiles against an fp32
reference, with ``torch.cuda.set_sync_debug_mode("error")`` around them.
"""
from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triptych.kernels import choice, get_ops, torch_ref, torch_varlen
from triptych.kernels.torch_varlen import Run, equal_runs

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (varlen_attn, SDPA's cuDNN/flash backends)")


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


def dense(q, k, v, lens, scale, causal):
    """fp32, one segment at a time, K/V repeated for GQA: the plainest reference."""
    outs, s, g = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (x[s:s + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
                    .transpose(0, 1))
        s += n
    return torch.cat(outs)


def batch(lens, h, hkv, d, dtype, device="cpu", seed=0):
    """q/k/v as strided views of one fused projection, as the models pass them."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, h + 2 * hkv, d, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([h, hkv, hkv], dim=1)
    cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    return q, k, v, cu, torch.from_numpy(cu).to(device)


def test_equal_runs():
    assert equal_runs(np.array([0, 5, 12, 15, 18])) == [Run(0, 5, 1, 5), Run(5, 12, 1, 7),
                                                       Run(12, 18, 2, 3)]
    assert equal_runs(np.array([0, 4, 4, 8, 12])) == [Run(0, 4, 1, 4), Run(4, 12, 2, 4)]
    assert equal_runs(np.array([0])) == []


@pytest.mark.parametrize("d", [64, 72, 80, 128])
@pytest.mark.parametrize("g", [1, 2, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prefill_equals_the_paged_path(d, g, dtype):
    """Chunks of several lengths (a run of two equal ones among them), no cached prefix:
    the fresh path equals the paged reference reading the same K/V from the cache."""
    lens, hkv, bs = [5, 9, 9, 1, 13], 2, 4
    q, k, v, cu, cu_t = batch(lens, g * hkv, hkv, d, dtype)
    nblk = [-(-n // bs) for n in lens]
    k_cache = torch.zeros(sum(nblk) + 1, bs, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    slots, nxt = [], 1
    for r, (n, nb) in enumerate(zip(lens, nblk)):
        bt[r, :nb] = torch.arange(nxt, nxt + nb)
        slots += [nxt * bs + i for i in range(n)]
        nxt += nb
    torch_ref.reshape_and_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    paged = torch_ref.paged_prefill_attention(q, k_cache, v_cache, bt, cu_t, seq_lens, scale)
    got = choice.varlen_causal_attention(q, k, v, cu_t, scale, max_seqlen=max(lens),
                                         cu_seqlens_cpu=cu)
    close(got, paged, dtype)
    close(got, dense(q, k, v, lens, scale, True), dtype)
    one = choice.varlen_causal_attention(q[:13], k[:13], v[:13], cu_t[:2], scale,
                                         cu_seqlens_cpu=np.array([0, 13]))  # a single run
    close(one, dense(q[:13], k[:13], v[:13], [13], scale, True), dtype)


@pytest.mark.parametrize("d", [72, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_varlen_equals_the_reference(d, dtype):
    lens = [1, 16, 16, 23]
    q, k, v, cu, cu_t = batch(lens, 4, 4, d, dtype, seed=1)
    got = get_ops("triton").varlen_attention(q, k, v, cu_t, d ** -0.5, max_seqlen=23,
                                             cu_seqlens_cpu=cu)
    close(got, torch_ref.varlen_attention(q, k, v, cu_t, d ** -0.5, cu_seqlens_cpu=cu), dtype)
    close(got, dense(q, k, v, lens, d ** -0.5, False), dtype)


def test_backends_keep_their_kernels():
    """The torch / cpu backends keep today's paged prefill and reference varlen (the CPU's
    production path); the triton backend gets the choice's functions."""
    ops = get_ops("torch")
    assert ops.varlen_causal_attention is None and ops.varlen_attention is torch_ref.varlen_attention
    assert ops.grouped_mm_for(torch.bfloat16, torch.device("cpu")) is None
    tri = get_ops("triton")
    assert tri.varlen_causal_attention is choice.varlen_causal_attention
    assert tri.varlen_attention is choice.varlen_attention


def test_installed_torch_varlen_api_is_detected():
    api = torch_varlen.varlen_api()
    if api is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    assert api.causal in ({"window_size": (-1, 0)}, {"is_causal": True})
    assert api.gqa == ("enable_gqa" in inspect.signature(api.fn).parameters)


def _stand_in(with_gqa: bool):
    """varlen_attn's signature in torch 2.11 (no enable_gqa) or 2.13, computed densely."""
    calls = []

    def body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
             enable_gqa):
        assert cu_seq_q.dtype == torch.int32 and cu_seq_k is cu_seq_q
        assert isinstance(max_q, int) and max_q == max_k
        assert enable_gqa == (query.shape[1] != key.shape[1]), "GQA without enable_gqa"
        calls.append(window_size)
        lens = torch.diff(cu_seq_q).tolist()
        return dense(query, key, value, lens, scale, tuple(window_size) == (-1, 0))

    if with_gqa:
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
               scale=None, window_size=(-1, -1), enable_gqa=False):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                        window_size, enable_gqa)
    else:
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
               scale=None, window_size=(-1, -1)):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                        window_size, False)
    return fn, calls


@pytest.mark.parametrize("with_gqa", [True, False], ids=["torch2.13", "torch2.11"])
def test_varlen_attn_call_for_each_signature(monkeypatch, with_gqa):
    """The call is built from the detected signature: causal as window_size (-1, 0), GQA
    by enable_gqa where the API takes it, else with K/V heads repeated (torch 2.11: still
    one launch, not an SDPA call per run), int32 boundaries."""
    from torch.nn.attention import varlen

    fn, calls = _stand_in(with_gqa)
    monkeypatch.setattr(varlen, "varlen_attn", fn)
    torch_varlen.varlen_api.cache_clear()
    try:
        api = torch_varlen.varlen_api()
        assert api is not None and api.gqa == with_gqa
        lens = [3, 8, 5]
        for h, hkv in ((4, 4), (4, 2)):
            q, k, v, _, cu_t = batch(lens, h, hkv, 16, torch.float32)
            for causal in (True, False):
                got = torch_varlen.flash_varlen(q, k, v, cu_t.long(), 8, 0.25, causal)
                close(got, dense(q, k, v, lens, 0.25, causal), torch.float32)
        assert calls[:2] == [(-1, 0), (-1, -1)]
    finally:
        torch_varlen.varlen_api.cache_clear()


def test_cpu_tensors_never_take_varlen_attn():
    q, k, _, _, _ = batch([4], 4, 2, 64, torch.bfloat16)
    assert not choice.flash_usable(q, k)


def test_the_choice_is_one_line_logged_once(caplog):
    line = choice.describe("triton", cuda=True)
    for phase in ("decode: Triton paged", "prefill without a cached prefix: SDPA",
                  "prefill with a cached prefix: Triton paged", "vision: SDPA",
                  "MoE experts:"):
        assert phase in line
    assert "\n" not in line and "torch paged" in choice.describe("torch")
    choice.log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="triptych.kernels"):
        get_ops("torch")
        get_ops("torch")
    msgs = [r.getMessage() for r in caplog.records if r.name == "triptych.kernels"]
    assert len(msgs) == 1 and "per phase (torch backend" in msgs[0]


def test_engine_steps_take_the_fresh_and_the_paged_path(tiny_qwen2_vl):
    """Triton engine (interpreter): first chunks go through the fresh path; the rest of a
    chunked prompt and a prompt with prefix-cache hits through the paged kernel; greedy
    ids equal the torch engine's (paged everywhere)."""
    from triptych import LLM, SamplingParams
    from triptych.engine.runner.forward_context import get_forward_context

    prompts = [list(range(10, 10 + n)) for n in (5, 9, 9, 21)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    knobs = {"block_size": 4, "kv_cache_memory": "16MiB", "max_num_batched_tokens": 32}
    llm = LLM(tiny_qwen2_vl, attention_backend="triton", **knobs)
    ops = llm.engine.core.runner.ops
    seen: list[tuple[str, bool]] = []

    def counted(name, fn):
        def wrapper(*a, **k):
            meta = get_forward_context().attn
            seen.append((name, bool(np.array_equal(np.diff(meta.cu_seqlens_q_cpu),
                                                   meta.seq_lens_cpu))))
            return fn(*a, **k)
        wrapper.make_plan = getattr(fn, "make_plan", None)
        return wrapper

    ops.varlen_causal_attention = counted("fresh", ops.varlen_causal_attention)
    ops.paged_prefill_attention = counted("paged", ops.paged_prefill_attention)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert ("fresh", True) in seen and ("paged", False) in seen  # 32 tokens: 21 is cut
    assert all(fresh == (name == "fresh") for name, fresh in seen)
    seen.clear()
    longer = prompts[3] + [50, 51, 52, 53, 54]
    (hit,) = llm.generate([longer], sp, use_tqdm=False)
    assert hit.num_cached_tokens >= 20
    assert seen and all(s == ("paged", False) for s in seen)  # a chunk after cached blocks
    ref = LLM(tiny_qwen2_vl, attention_backend="torch", **knobs)
    assert [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)] == first
    assert ref.generate([longer], sp, use_tqdm=False)[0].outputs[0].token_ids == \
        hit.outputs[0].token_ids


@CUDA
@pytest.mark.parametrize("d", [64, 72, 80, 128])
@pytest.mark.parametrize("g", [1, 2, 6])
@pytest.mark.parametrize("lens", [[300], [64, 64, 64], [5, 17, 3, 33, 8, 64, 1, 128]],
                         ids=["one", "one-run", "many-runs"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_fresh_attention(d, g, lens, causal):
    """bf16 on the GPU: SDPA by runs (flash first) for few runs, varlen_attn for many,
    both against fp32 dense, without a host sync."""
    q, k, v, cu, cu_t = batch(lens, 2 * g, 2, d, torch.bfloat16, "cuda")
    many = len(equal_runs(cu)) > choice.SDPA_MAX_RUNS
    if many and d in (72, 80) and g == 1:
        assert choice.flash_usable(q, k) == (torch.cuda.get_device_capability() >= (8, 0))
    fn = choice.varlen_causal_attention if causal else choice.varlen_attention
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fn(q, k, v, cu_t, d ** -0.5, max_seqlen=max(lens), cu_seqlens_cpu=cu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    close(got, dense(q, k, v, lens, d ** -0.5, causal), torch.bfloat16)


@CUDA
@pytest.mark.parametrize("q_len", [1, 16, 24, 100])
def test_cuda_triton_prefill_short_chunks_after_a_prefix(q_len):
    """The paged Triton prefill's 16/32-row tiles: a chunk after a 700-token prefix."""
    from triptych.kernels.triton import ops as triton_ops

    bs, hkv, h, d, n = 16, 2, 12, 128, 700 + q_len
    nb = -(-n // bs)
    k_cache = torch.randn(nb + 3, bs, hkv, d, device="cuda").bfloat16()
    v_cache = torch.randn_like(k_cache)
    bt = torch.randperm(nb + 3, device="cuda")[:nb].int()[None]
    q = torch.randn(q_len, h, d, device="cuda").bfloat16()
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    got = triton_ops.paged_prefill_attention(q, k_cache, v_cache, bt, cu, sl, d ** -0.5,
                                             max_query_len=q_len)
    ref = torch_ref.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), bt,
                                            cu, sl, d ** -0.5)
    close(got, ref, torch.bfloat16)


def test_serving_sdpa_never_takes_cudnn():
    """cuDNN's SDPA compiles a graph per new sequence-length shape (~0.4 s each): a new
    prompt length or image size would stall the step that meets it. The serving path's
    SDPA allows flash, efficient and math only, flash first."""
    from torch.nn.attention import SDPBackend

    assert torch_varlen.SERVING_ORDER[0] == SDPBackend.FLASH_ATTENTION
    assert SDPBackend.CUDNN_ATTENTION not in torch_varlen.SERVING_ORDER
    with torch_varlen._cuda_priority()():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()


def test_mixed_steps_run_decode_rows_through_the_decode_kernel(tiny_qwen2_vl):
    """A prompt admitted beside running decodes (the common step under load): the decode
    rows, which the batch puts first whatever their order of arrival, take the decode kernel
    as one slice; the prompt's rows the prefill path (fresh q/k/v here: no cached prefix).
    Greedy ids equal the torch engine's, where every row of such a step went paged."""
    from triptych import LLM, SamplingParams

    first = [list(range(10, 40)), list(range(40, 52))]  # 30 + 12 > 32: the second waits
    late = list(range(60, 70))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    knobs = {"block_size": 4, "kv_cache_memory": "16MiB", "max_num_batched_tokens": 32,
             "enable_chunked_prefill": False, "max_model_len": 32}
    llm = LLM(tiny_qwen2_vl, attention_backend="triton", **knobs)
    ops = llm.engine.core.runner.ops
    calls: list[tuple[str, int]] = []

    def counted(name, fn):
        def wrapper(q, *a, **k):
            calls.append((name, q.shape[0]))
            return fn(q, *a, **k)
        wrapper.make_plan = getattr(fn, "make_plan", None)
        return wrapper

    for name in ("paged_decode_attention", "paged_prefill_attention",
                 "varlen_causal_attention"):
        setattr(ops, name, counted(name.split("_")[1], getattr(ops, name)))
    got = [o.outputs[0].token_ids for o in llm.generate(first + [late], sp, use_tqdm=False)]
    layers = llm.engine.core.shape.num_layers
    # step 2: the first prompt decodes (1 row) beside the others' 12 + 10 fresh rows
    mixed = [i for i in range(len(calls) - 1)
             if calls[i] == ("decode", 1) and calls[i + 1] == ("causal", 22)]
    assert len(mixed) == layers, calls[:12]
    assert ("paged", 23) not in calls  # (the old way: one prefill launch for every row)
    ref = LLM(tiny_qwen2_vl, attention_backend="torch", **knobs)
    assert [o.outputs[0].token_ids for o in ref.generate(first + [late], sp,
                                                        use_tqdm=False)] == got
