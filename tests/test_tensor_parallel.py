"""Tensor parallelism on the CPU (issue 11): gloo, 2 rank processes, the tiny checkpoints.

- TP=2 gives the greedy tokens of TP=1 and of HF transformers for the parity mix (images
  of odd sizes, chunked prefill through image spans, prefix hits, preemption), with the
  vision tower in "weights" mode (Qwen2-VL) and "data" mode (Qwen2.5-VL, window attention);
- the vision tower's embeddings in both modes equal TP=1's, in batch order, for a batch
  whose patch counts split unevenly; greedy outputs agree in both modes;
- a model whose sizes do not divide is refused before any process starts;
- kill -9 of a rank (or of rank 0) ends the group: its request fails, nothing hangs, the
  group restarts, and no process is left.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time

import pytest
import torch
from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_greedy, load_hf_model

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import _children, alive
from server_fixtures import image_chat as chat
from server_fixtures import img as image

KNOBS = {"block_size": 4, "num_kv_blocks": 24, "max_num_seqs": 8, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)


def parity_mix() -> list[list[dict]]:
    """Six requests whose prompts outgrow 24 blocks together (preemption), images of odd
    sizes that straddle the 16-token chunks, and a text-only one."""
    sizes = [(56, 56), (84, 56), (56, 112), (140, 84), (112, 112), (28, 28)]
    convs = [chat(f"Item {i}, describe it at length.", image(30 + i, w, h))
             for i, (w, h) in enumerate(sizes)]
    convs[3] = chat("Compare these two.", image(40, 84, 56), image(41, 56, 140))
    convs.append([{"role": "user", "content": "Tell me a story about a cat."}])
    return convs


def wait_until(cond, timeout: float, what: str) -> None:
    """Poll ``cond``; ``timeout`` is a hang guard, never a speed claim."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def assert_oracle(llm: LLM, hf, conv: list[dict], out) -> None:
    processed = llm.processor.process_chat(conv)
    tokens, tops = hf_greedy(hf, processed, GREEDY.max_tokens,
                             llm.get_tokenizer().pad_token_id or 0)
    assert out.outputs[0].token_ids == tokens
    for step, (mine, ref) in enumerate(zip(out.outputs[0].logprobs, tops)):
        for tok, lp in ref.items():
            assert abs(mine[tok].logprob - lp) < 1e-3, (step, tok, mine[tok].logprob, lp)


# -- the parity mix, through the worker processes --------------------------------------------
@pytest.mark.parametrize("arch,mode", [("qwen2_vl", "weights"), ("qwen2_5_vl", "data")])
def test_tp2_equals_tp1_and_hf_on_the_parity_mix(arch, mode, request):
    model = request.getfixturevalue(f"tiny_{arch}")
    convs = parity_mix()
    one = LLM(model, **KNOBS)
    p = one.processor.process_chat(convs[4])  # a 112x112 image: 16 placeholder tokens
    it = p.mm_items[0]
    assert it.offset // 16 != (it.end - 1) // 16, "an image span must straddle a chunk"
    want = one.chat(convs, GREEDY, use_tqdm=False)
    assert one.engine.scheduler.num_preemptions_total > 0
    two = LLM(model, tensor_parallel_size=2, mm_encoder_tp_mode=mode, **KNOBS)
    try:
        got = two.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        (again,) = two.chat([convs[0]], GREEDY, use_tqdm=False)  # prefix hit, image included
        assert again.num_cached_tokens > 0
        assert again.outputs[0].token_ids == got[0].outputs[0].token_ids
        wait_until(lambda: two.pools.stats().get("num_preemptions_total", 0) > 0, 120,
                   "the TP=2 worker to report its preemptions")
    finally:
        two.close()
    hf = load_hf_model(model)
    for conv, out in zip(convs, got):
        assert_oracle(one, hf, conv, out)


def test_kv_moves_between_groups_of_different_sizes(tiny_qwen2_vl):
    """P/D: a prefill group of 4 ranks (2 KV heads, so each is held by 2 ranks) hands its
    KV to a decode group of 2: the wire carries all heads, each side slices its own."""
    convs = parity_mix()[:3]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_qwen2_vl, block_size=4).chat(
        convs, sp, use_tqdm=False)]
    pd = LLM(tiny_qwen2_vl, block_size=4, prefill_workers=1, decode_workers=1,
             prefill_tensor_parallel_size=4, decode_tensor_parallel_size=2,
             mm_encoder_tp_mode="data", max_num_batched_tokens=16)
    try:
        got = pd.chat(convs, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        wait_until(lambda: pd.pools.stats().get("kv_transfers_total", 0) >= 3, 120,
                   "the prefill worker to report its transfers")
    finally:
        pd.close()


def test_kv_moves_rank_to_rank_between_groups_of_the_same_size(tiny_qwen2_vl):
    """P/D with 2 ranks on each side: each prefill rank sends its own KV heads to the decode
    rank of the same number (nothing gathered through rank 0); outputs equal one engine's."""
    convs = parity_mix()[:3]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_qwen2_vl, block_size=4).chat(
        convs, sp, use_tqdm=False)]
    pd = LLM(tiny_qwen2_vl, block_size=4, prefill_workers=1, decode_workers=1,
             tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        got = pd.chat(convs, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        # (rank-to-rank counts messages, several per chunked request: wait on whole requests)
        wait_until(lambda: pd.pools.stats().get("kv_transfers_total", 0) >= 3, 120,
                   "the prefill worker to report its three transfers")
        s = pd.pools.stats()
        assert s["kv_transfer_rank_to_rank_total"] >= s["kv_transfers_total"] >= 3
    finally:
        pd.close()


# -- the vision tower's two modes, rank 0 in this process ------------------------------------
def uneven_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One large item among five small ones (in the middle, so the balanced split moves it
    to another rank than its neighbours): patches 16x20=320 vs 16, 24, 24, 16, 4."""
    grid = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 16, 20], [1, 6, 4], [1, 4, 4], [1, 2, 2]])
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g), grid


def core_greedy(core, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p.prompt_token_ids, sp, p.mm_items)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_encoder_modes_match_one_rank(arch, request):
    from triptych.config import EngineConfig
    from triptych.parallel.loader import load_engine_core

    model = request.getfixturevalue(f"tiny_{arch}")
    one = LLM(model, **KNOBS)
    pixels, grid = uneven_batch()
    with torch.no_grad():
        ref = one.engine.core.model.encode_images(pixels, grid)
    convs = [chat("Two:", image(50, 84, 56), image(51, 224, 112)), chat("One:", image(52, 56, 56))]
    prompts = [one.processor.process_chat(c) for c in convs]
    want = [o.outputs[0].token_ids for o in one.chat(
        convs, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    for mode in ("data", "weights"):
        core = load_engine_core(EngineConfig(model=model, tensor_parallel_size=2,
                                             mm_encoder_tp_mode=mode, **KNOBS))
        pids = [p.pid for p in core.group.procs]
        try:
            assert core.group.encoder_mode == mode
            with torch.no_grad():
                got = core.encoder.encode_fn(pixels, grid)
            assert [g.shape for g in got] == [r.shape for r in ref]  # batch order kept
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
            assert core_greedy(core, prompts) == want
        finally:
            core.close()
        assert not any(alive(pid) for pid in pids)


# -- refusal ----------------------------------------------------------------------------------
def test_sizes_that_do_not_divide_are_refused_before_any_process(tiny_qwen2_vl):
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3 must divide "
                                         r"num_attention_heads=4, .*sizes that work: 1, 2\b"):
        LLM(tiny_qwen2_vl, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"decode_tensor_parallel_size=3|"
                                         r"tensor_parallel_size=3 must divide"):
        LLM(tiny_qwen2_vl, decode_workers=1, decode_tensor_parallel_size=3)
    assert set(_children(os.getpid())) == before


def test_size_rules():
    from types import SimpleNamespace

    from triptych.models.tp_plan import check_tp_sizes

    def cfg(heads=8, kv=2, inter=64, vocab=96, vheads=4):
        text = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                               intermediate_size=inter, vocab_size=vocab)
        vision = SimpleNamespace(embed_dim=32, mlp_ratio=4, num_heads=vheads,
                                 spatial_merge_size=2)
        return SimpleNamespace(text_config=text, vision_config=vision, model_type="qwen2_vl")

    check_tp_sizes(cfg(), 4, "weights")  # 2 KV heads over 4 ranks: replicated, allowed
    check_tp_sizes(cfg(), 8, "data")
    with pytest.raises(ValueError, match=r"vision num_heads=4.*mm_encoder_tp_mode=data"):
        check_tp_sizes(cfg(), 8, "weights")
    with pytest.raises(ValueError, match=r"vocab_size=97.*sizes that work: 1$"):
        check_tp_sizes(cfg(vocab=97), 2, "data")
    with pytest.raises(ValueError, match=r"num_key_value_heads=3, intermediate_size=66"):
        check_tp_sizes(cfg(kv=3, heads=12, inter=66), 4, "data")


def test_a_model_that_cannot_split_images_falls_back_to_weights(caplog):
    from triptych.models import Qwen2VLForCausalLM
    from triptych.models.tp_plan import resolve_encoder_mode

    class NoSplit:  # a model class without supports_encoder_data_parallel
        pass

    assert resolve_encoder_mode(Qwen2VLForCausalLM, "data", 2) == "data"
    with caplog.at_level("INFO", logger="triptych.models"):
        assert resolve_encoder_mode(NoSplit, "data", 2) == "weights"
    assert [r.message for r in caplog.records if "falls back" in r.message] == [
        "NoSplit cannot split images across ranks; mm_encoder_tp_mode falls back to weights"]
    assert resolve_encoder_mode(NoSplit, "data", 1) == "data"  # nothing to split at TP=1


# -- failure ----------------------------------------------------------------------------------
def test_kill_a_rank_ends_the_group_cleanly(tiny_qwen2_vl):
    llm = LLM(tiny_qwen2_vl, tensor_parallel_size=2, block_size=4, max_model_len=4096)
    router = llm.pools.router
    seen: list[int] = []
    try:
        worker = router.supervisor.workers[0]
        rank0 = worker.pid
        wait_until(lambda: len(_children(rank0)) == 1, 120, "rank 1")
        (rank1,) = _children(rank0)
        seen += [rank0, rank1]
        result: dict = {}

        def run() -> None:
            try:
                result["out"] = llm.generate([[5, 6, 7]], SamplingParams(
                    temperature=0, max_tokens=3000, ignore_eos=True), use_tqdm=False)
            except Exception as e:  # noqa: BLE001 (the test looks at what the caller saw)
                result["error"] = e

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: worker.stats.get("num_requests_running", 0) > 0, 120,
                   "the request to run")
        os.kill(rank1, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the request hung after its rank died"
        assert "error" in result and "no live worker" in str(result["error"])
        wait_until(lambda: not alive(rank0), 120, "rank 0 to exit")
        # the supervisor restarts the whole group; it serves again
        wait_until(lambda: worker.state == "up" and worker.pid != rank0, 120, "the restart")
        new0 = worker.pid
        wait_until(lambda: len(_children(new0)) == 1, 120, "the new rank 1")
        seen += [new0, *_children(new0)]
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4),
                              use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        # rank 0 killed: its rank goes with it (parent-death signal)
        os.kill(new0, signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in seen[2:]), 120, "the orphaned rank to exit")
        wait_until(lambda: worker.state == "up" and worker.pid != new0, 120, "the second restart")
        seen += [worker.pid, *_children(worker.pid)]
    finally:
        llm.close()
    wait_until(lambda: not any(alive(p) for p in seen), 120, "every rank to exit")
    assert not [d for d in os.listdir(tempfile.gettempdir()) if any(
        d.startswith(f"triptych-{p}-ipc-tp-") for p in seen)]
