"""Decode steps as CUDA graphs (engine/device/cuda_graphs.py), held on the CPU where they can be.

The bucket and padding rules and the knobs are functions, tested with numbers. The graph
path itself (persistent buffers, padding rows, the decode kernel's fixed split count with
its partition read from device memory) runs here with its replay done eagerly: the Triton
kernels under the interpreter, the same buffers and the same launch a captured graph
replays. Its greedy ids must equal the eager engine's at batch 1, 3 and 8 (padded to the
next captured size), at short and long contexts in one bucket, and while requests join and
leave (stale persistent buffers are the classic bug). On a GPU (CUDA-only tests at the
end) the real capture must give the same ids as eager.
"""
from __future__ import annotations

import os

import pytest
import torch

from triptych import LLM, SamplingParams
from triptych.config import EngineConfig
from triptych.engine.device.cuda_graphs import bucket_for, capture_sizes, graph_plan

pytest.importorskip("triton")


def test_capture_sizes_follow_vllms_knobs():
    assert capture_sizes(None, None, 128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(None, None, 1024)[-1] == 256  # at most 256 unless asked
    assert capture_sizes(None, None, 3) == [1, 2, 4, 8]  # max_num_seqs rounded up to 8
    assert capture_sizes(None, 20, 128) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes([4, 1, 64, 4], None, 128) == [1, 4, 64]
    assert capture_sizes([4, 1, 64], 8, 128) == [1, 4]
    with pytest.raises(ValueError):
        capture_sizes([0, 2], None, 8)


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, None]


def test_knobs_and_when_graphs_are_off(tiny_qwen2_vl):
    cfg = EngineConfig.from_kwargs(model=tiny_qwen2_vl, enforce_eager=False,
                                   compilation_config='{"cudagraph_capture_sizes": [1, 2, 4]}',
                                   cuda_graph_max_bs=2)
    assert cfg.compilation_dict() == {"cudagraph_capture_sizes": [1, 2, 4],
                                      "max_cudagraph_capture_size": 2}
    model = object()
    cuda = torch.device("cuda")
    assert graph_plan(cfg, cuda, model, "triton", 1).sizes == [1, 2]
    assert "CUDA device" in graph_plan(cfg, torch.device("cpu"), model, "triton", 1).reason
    assert "tensor parallelism" in graph_plan(cfg, cuda, model, "triton", 2).reason
    assert "triton" in graph_plan(cfg, cuda, model, "torch", 1).reason
    eager = EngineConfig(model=tiny_qwen2_vl)  # the default until measured on a GPU
    assert "enforce_eager" in graph_plan(eager, cuda, model, "triton", 1).reason

    class MoE:
        cuda_graph_blocker = "the MoE expert loop reads the device"
    assert graph_plan(cfg, cuda, MoE(), "triton", 1).reason.startswith("the MoE")
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(model=tiny_qwen2_vl, compilation_config='{"level": 3}')
    with pytest.raises(ValueError, match="positive batch sizes"):
        EngineConfig(model=tiny_qwen2_vl, compilation_config={"cudagraph_capture_sizes": [0]})


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets the interpreter first"
    return LLM(tiny_qwen2_vl, block_size=4, kv_cache_memory="16MiB", attention_backend="triton")


def _prompts(n: int, lengths: list[int]) -> list[dict]:
    words = "the cat sat on a mat and looked at the dog who barked twice".split()
    return [{"prompt": " ".join(words[(i + j) % len(words)] for j in range(lengths[i % len(lengths)]))}
            for i in range(n)]


def _run(llm: LLM, prompts: list[dict], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_path_gives_the_eager_ids(llm, batch):
    runner = llm.engine.core.runner
    # short (17-ish tokens) and long (~300) contexts in one batch, ending at different steps
    prompts = _prompts(batch, [5, 60])
    max_tokens = [4 + (i % 3) * 3 for i in range(batch)]
    runner.disable_cuda_graphs()
    eager = _run(llm, prompts, max_tokens)
    runner.enable_cuda_graphs([1, 2, 4, 8], llm.engine.max_model_len)
    assert runner.graphs.eager_replay  # (no CUDA: capture rehearsed, replays run eagerly)
    try:
        graphed = _run(llm, prompts, max_tokens)
        assert runner.graphs.num_replays > 0, "no decode step took the graph path"
    finally:
        runner.disable_cuda_graphs()
    assert graphed == eager


def test_requests_joining_and_leaving_between_replays(llm):
    """A steady stream: rows leave at different steps and new ones join, so every bucket
    size is replayed over buffers that held other requests' rows before."""
    runner = llm.engine.core.runner
    prompts = _prompts(6, [3, 40, 9])
    max_tokens = [2, 9, 5, 3, 8, 6]
    runner.disable_cuda_graphs()
    eager = _run(llm, prompts, max_tokens)
    runner.enable_cuda_graphs([1, 2, 4], llm.engine.max_model_len)  # 5-6 rows: eager
    try:
        graphed = _run(llm, prompts, max_tokens)
        assert runner.graphs.num_replays > 0
    finally:
        runner.disable_cuda_graphs()
    assert graphed == eager


def test_graphs_end_at_the_hidden_states(llm):
    """What a captured size keeps alive between replays is its output: [size, hidden], not
    [size, vocab] fp32 logits (2.6 GB at 256 rows of a 151,936-token vocab); the LM head runs
    after the replay on the step's rows only."""
    runner = llm.engine.core.runner
    runner.enable_cuda_graphs([1, 2], llm.engine.max_model_len)
    try:
        hidden = runner.graphs.forward(2)
    finally:
        runner.disable_cuda_graphs()
    assert hidden.shape == (2, llm.engine.core.shape.hidden_size)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_give_the_eager_ids_on_cuda(tiny_qwen2_vl):
    os.environ.pop("TRITON_INTERPRET", None)
    prompts = _prompts(8, [5, 60, 200])
    max_tokens = [6 + i % 4 for i in range(8)]
    with LLM(tiny_qwen2_vl, device="cuda", dtype="float32") as eager_llm:
        eager = _run(eager_llm, prompts, max_tokens)
    with LLM(tiny_qwen2_vl, device="cuda", dtype="float32", enforce_eager=False,
             compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}) as g:
        graphs = g.engine.core.runner.graphs
        assert graphs is not None
        hidden = g.engine.core.shape.hidden_size
        assert all(o.shape[-1] == hidden for o in graphs.outputs.values())
        got = _run(g, prompts, max_tokens)
        assert g.engine.core.runner.graphs.num_replays > 0
    assert got == eager
