"""The persistent batch under churn, against the oracle: requests join mid-batch, finish
at different lengths, are preempted and resumed, are aborted, an id is reused by a new
request, and a request arrives with its KV already computed; every completion still
equals HF's greedy tokens and the batch's bookkeeping stays consistent at every step."""
from __future__ import annotations

import os
import sys

import pytest
from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_greedy, load_hf_model

sys.path.insert(0, os.path.dirname(__file__))
from kv_handoff import HandOff  # noqa: E402
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    return load_hf_model(tiny_qwen2_vl)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_join_finish_preempt_abort_reuse_import(tiny_qwen2_vl, oracle):
    probe = LLM(tiny_qwen2_vl, block_size=4)
    convs = {f"r{i}": chat(f"Item {i}, describe it.", image(30 + i, 56, 28 * (1 + i % 2)))
             if i % 3 else [{"role": "user", "content": f"Text request {i}, go on."}]
             for i in range(7)}
    lens = {rid: 6 + 2 * (i % 4) for i, rid in enumerate(convs)}
    processed = {rid: probe.processor.process_chat(c) for rid, c in convs.items()}
    # Just enough blocks for the first four prompts: as soon as they grow, someone is
    # preempted (and later resumed with its output tokens recomputed).
    blocks = sum(-(-len(processed[f"r{i}"].prompt_token_ids) // 4) for i in range(4)) + 1
    llm = LLM(tiny_qwen2_vl, block_size=4, num_kv_blocks=blocks, max_num_seqs=8,
              enable_prefix_caching=False)
    eng = llm.engine
    pad = llm.get_tokenizer().pad_token_id or 0
    done: dict[str, list[int]] = {}

    def add(rid: str, key: str) -> None:
        p = processed[key]
        eng.add_request(rid, p.prompt_token_ids, greedy(lens[key]), p.mm_items)

    def step() -> None:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        eng.runner.batch.check_integrity()
        eng.kv.check_integrity()

    for rid in ("r0", "r1", "r2", "r3"):
        add(rid, rid)
    for _ in range(3):
        step()
    add("r4", "r4")  # joins while the others decode
    add("r5", "r5")
    step()
    eng.abort_request(["r1"])  # aborted mid-batch: its row must go
    step()
    assert "r1" not in eng.runner.batch
    add("r1", "r6")  # the aborted id, reused by a different prompt
    # a request whose prompt KV was computed by another engine (a prefill worker), moved
    # the way the pools move it (KVSender -> connector -> KVReceiver)
    p = processed["r2"]
    link = HandOff(probe.engine.core, eng.core)
    reserved = link.reserve("imp", p.prompt_token_ids, greedy(5), p.mm_items)
    while reserved is None:  # reserved as soon as the busy cache has room, mid-batch
        step()
        (reserved, *_) = link.receiver.retry() or [None]
    link.prefill_and_send("imp", p.prompt_token_ids, greedy(5), p.mm_items, reserved)
    imp = link.receive()
    link.close()
    assert imp is not None and imp in eng.scheduler.running
    assert eng.has_unfinished_requests() and len(eng.scheduler.running) > 1
    while eng.has_unfinished_requests():
        step()
    assert eng.scheduler.num_preemptions_total > 0, "the KV budget must force preemptions"
    assert eng.kv.pool.num_free_blocks == blocks
    # rows of the last step's finishers are dropped at the next execute (nothing else left)
    assert all(eng.runner.batch.reqs[r].finished for r in eng.runner.batch.index.values())
    expect = {"r0": "r0", "r2": "r2", "r3": "r3", "r4": "r4", "r5": "r5", "r1": "r6"}
    assert set(done) == set(expect)  # (imp's tokens: its request object, below)
    for rid, key in expect.items():
        tokens, _ = hf_greedy(oracle, processed[key], lens[key], pad)
        assert done[rid] == tokens, rid
    tokens, _ = hf_greedy(oracle, processed["r2"], 5, pad)
    assert imp.finished and imp.output_token_ids == tokens
