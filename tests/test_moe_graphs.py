"""MoE experts without a device read (models/fused_moe.py ``grouped_experts``), so a CUDA
graph can hold a Qwen3-VL-MoE decode step where torch offers a sync-free grouped GEMM.

On the CPU: the grouped path equals the per-expert loop (fp32 and bf16, experts nobody
picked, one token); a Qwen3-VL-MoE engine on the triton backend (interpreter) reads
nothing back inside its forward and gives the torch engine's greedy ids; the models say
whether a graph can hold them and why not. On CUDA (skipped elsewhere): the same on the
GPU's bf16 grouped GEMM under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from triptych.kernels import choice, get_ops
from triptych.models.fused_moe import SparseMoeBlock, fused_experts, grouped_experts, route

sys.path.insert(0, os.path.dirname(__file__))
from host_syncs import count_host_syncs, report

GMM = pytest.mark.skipif(getattr(torch, "_grouped_mm", None) is None,
                         reason=f"torch {torch.__version__} has no torch._grouped_mm")


def experts(e=6, h=32, inter=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(e, h, generator=g) * 0.5
    gate_up = torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5
    down = torch.randn(e, h, inter, generator=g) * inter ** -0.5
    return (x.to(dtype).to(device) for x in (gate, gate_up, down))


@GMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_grouped_experts_equal_the_loop(dtype, t):
    gate, gate_up, down = experts(dtype=dtype)
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(t)).to(dtype)
    ids, w = route(x, gate, 2)
    gmm = choice.grouped_mm_for(dtype, x.device)
    assert gmm is not None
    want = fused_experts(x, gate_up, down, ids, w)
    got = grouped_experts(x, gate_up, down, ids, w, gmm)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if t == 1:  # 4 of 6 experts get no token
        assert len(ids.unique()) == 2


@GMM
def test_moe_block_reads_nothing_back_on_the_triton_backend():
    """The block's forward under the device-read counter: none with the triton backend's
    grouped GEMM, one a forward with the torch backend's loop (the counter sees it)."""
    gate, gate_up, down = experts()
    x = torch.randn(9, 32)
    outs, reads = {}, {}
    for backend in ("triton", "torch"):
        block = SparseMoeBlock(32, 16, 6, 2, get_ops(backend))
        with torch.no_grad():
            block.gate.weight.copy_(gate)
            block.experts.gate_up_proj.copy_(gate_up)
            block.experts.down_proj.copy_(down)
            with count_host_syncs() as syncs:
                outs[backend] = block(x)
        reads[backend] = syncs.events
        assert block.reads_back == (backend == "torch")
    assert not reads["triton"], report(reads["triton"])
    # one line reads the counts back (bincount, then tolist: the counter names both)
    assert len({where for _, where in reads["torch"]}) == 1, report(reads["torch"])
    assert {what for what, _ in reads["torch"]} == {"aten.bincount", "Tensor.tolist"}
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-6)


def test_which_models_a_cuda_graph_can_hold():
    from triptych.models.internvl import InternVLForCausalLM
    from triptych.models.qwen2_vl import Qwen2VLForCausalLM

    assert Qwen2VLForCausalLM.supports_cuda_graphs and not Qwen2VLForCausalLM.cuda_graph_blocker
    assert InternVLForCausalLM.supports_cuda_graphs
    cpu = torch.device("cpu")
    assert choice.grouped_mm_for(torch.float32, torch.device("meta")) is None
    assert get_ops("torch").grouped_mm_for(torch.bfloat16, cpu) is None


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen3_vl_moe", str(tmp_path_factory.mktemp("tiny") / "qwen3_vl_moe"))


@GMM
def test_moe_engine_forward_reads_nothing_back(tiny_moe):
    """A Qwen3-VL-MoE engine on the triton backend (interpreter): no device read inside the
    forward, one per decode step; greedy ids equal the torch engine's (the loop)."""
    from triptych import LLM, SamplingParams

    knobs = {"block_size": 4, "kv_cache_memory": "16MiB", "max_model_len": 256}
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [list(range(20, 31))]
    tri = LLM(tiny_moe, attention_backend="triton", **knobs)
    model = tri.engine.core.model
    assert model.supports_cuda_graphs and model.cuda_graph_blocker == ""
    forward, inside = model.forward, []

    def counted(*a, **k):
        n = len(syncs.events)
        try:
            return forward(*a, **k)
        finally:
            inside.extend(syncs.events[n:])

    model.forward = counted
    try:
        with count_host_syncs() as syncs:
            (out,) = tri.generate(prompt, sp, use_tqdm=False)
    finally:
        del model.forward
    assert not inside, report(inside)
    ref = LLM(tiny_moe, attention_backend="torch", **knobs)
    assert not ref.engine.core.model.supports_cuda_graphs
    assert "per-expert token counts" in ref.engine.core.model.cuda_graph_blocker
    (want,) = ref.generate(prompt, sp, use_tqdm=False)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 64, 300])
def test_cuda_grouped_experts(t):
    """bf16 on the GPU: sync-free where torch._grouped_mm's fast path runs (sm90/sm100),
    equal to the loop; elsewhere the block keeps the loop and says so."""
    gate, gate_up, down = experts(e=16, h=256, inter=128, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(t, 256, device="cuda").bfloat16()
    ids, w = route(x, gate, 4)
    gmm = choice.grouped_mm_for(torch.bfloat16, x.device)
    if gmm is None:
        assert torch.cuda.get_device_capability()[0] not in (9, 10) or \
            getattr(torch, "_grouped_mm", None) is None
        pytest.skip("no sync-free grouped GEMM on this GPU / torch: the loop stays")
    want = fused_experts(x, gate_up, down, ids, w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_experts(x, gate_up, down, ids, w, gmm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
