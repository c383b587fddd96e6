"""Disaggregated pools (real worker processes): greedy outputs equal HF transformers and the
colocated engine in every layout, through LLM(...) and through `triptych serve`, for the
parity mix: several images of odd sizes, chunked prefill through an image span, prefix-cache
hits on the decode side, preemption on the decode side."""
from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest
from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_greedy, load_hf_model

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    data_url,
    image_part,
    img,
    module_server,
    png,
    text_part,
    user,
    wait_for,
)
from server_fixtures import image_chat as chat
from server_fixtures import img as image

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# The parity mix: odd sizes, two images, text only, an image whose span straddles a chunk
# boundary (max_num_batched_tokens 16), and a repeat (prefix hits on the decode side).
CONVS = [chat("What is in this picture?", image(1, 56, 84)),
         chat("Compare these.", image(2, 84, 56), image(3, 112, 56)),
         [{"role": "user", "content": "Tell me a story about a cat."}],
         chat("Describe.", image(4, 112, 112)),
         chat("What is in this picture?", image(1, 56, 84))]
KNOBS = {"block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 512}


def stats_when(llm: LLM, cond, what: str) -> dict[str, float]:
    """The pools' stats once ``cond(stats)`` holds: workers report every 0.25 s, so a test
    waits for the report it needs (a condition with a hang guard, not a sleep)."""
    def ready() -> dict[str, float] | None:
        s = llm.pools.stats()
        return s if cond(s) else None
    return wait_for(ready, what)


@pytest.fixture(scope="module")
def reference(tiny_qwen2_vl):
    """HF's greedy tokens for the mix, and the colocated engine's."""
    llm = LLM(tiny_qwen2_vl, **KNOBS)
    outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
    hf = load_hf_model(tiny_qwen2_vl)
    tok = llm.get_tokenizer()
    oracle = [hf_greedy(hf, llm.processor.process_chat(c), MAX_TOKENS, tok.pad_token_id or 0)[0]
              for c in CONVS]
    colocated = [o.outputs[0].token_ids for o in outs]
    assert colocated == oracle
    return oracle


@pytest.mark.parametrize("layout", [
    {"encode_workers": 1, "prefill_workers": 2, "decode_workers": 2},  # 1e2p2d
    {"prefill_workers": 1, "decode_workers": 1, "kv_transfer": "tcp"},  # encoder in prefill
    {"encode_workers": 1, "decode_workers": 1},  # E+PD
    {"decode_workers": 1},  # PD: a decode worker that encodes and prefills too
], ids=["1e2p2d", "1p1d-tcp", "1e1d", "1d"])
def test_pools_equal_hf_and_colocated(tiny_qwen2_vl, reference, layout):
    llm = LLM(tiny_qwen2_vl, **KNOBS, **layout)
    try:
        outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        # The repeat finds its prompt in the prefix cache (of the worker that prefills it,
        # routed there by the prefix-aware router).
        again = llm.chat(CONVS[:1], GREEDY, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == reference[0] and again.num_cached_tokens > 0
        if "prefill_workers" in layout:
            stats_when(llm, lambda s: s.get("pool/prefill/kv_transfer_bytes_total", 0) > 0
                       and s.get("pool/decode/kv_transfer_bytes_received_total", 0) > 0,
                       "KV transfers")
        if "encode_workers" in layout:
            # Each distinct image once: the repeats are held where their requests prefill.
            s = stats_when(llm, lambda s: s.get("pool/encode/items_encoded_total", 0) >= 4,
                           "the encode pool's report")
            assert s["pool/encode/items_encoded_total"] == 4
        assert llm.pools.stats()["request_migrations_total"] == 0
    finally:
        llm.close()
    assert all(w.proc.poll() is not None for w in llm.pools.router.supervisor.workers)


def test_decode_side_prefix_hits_and_preemption(tiny_qwen2_vl, reference):
    """P/D with a small decode cache: the decode worker preempts, hands image requests back
    (their embeddings are on the prefill side) and recomputes text ones; outputs stay equal.
    A repeat reserves its cached blocks on the decode side and receives only the rest."""
    llm = LLM(tiny_qwen2_vl, **{**KNOBS, "num_kv_blocks": 48, "max_num_seqs": 8},
              prefill_workers=1, decode_workers=1)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        convs = CONVS[:4]
        outs = llm.chat(convs, sp, use_tqdm=False)
        colocated = LLM(tiny_qwen2_vl, **{**KNOBS, "num_kv_blocks": 400}).chat(
            convs, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == \
            [o.outputs[0].token_ids for o in colocated]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        s = stats_when(llm, lambda s: s.get("pool/decode/generation_tokens_total", 0)
                       + s.get("pool/prefill/generation_tokens_total", 0) >= tokens,
                       "the decode report")
        assert s["pool/decode/num_preemptions_total"] > 0
        before = s["pool/decode/kv_transfer_bytes_received_total"]
        hits_before = s["pool/decode/prefix_cache_hits"]
        again = llm.chat(convs[2:3], sp, use_tqdm=False)[0]  # text: stays cached on decode
        assert again.outputs[0].token_ids == outs[2].outputs[0].token_ids
        s = stats_when(llm, lambda s: s.get("pool/decode/kv_transfer_bytes_received_total", 0) >
                       before, "the repeat's transfer")
        moved = s["pool/decode/kv_transfer_bytes_received_total"] - before
        assert 0 < moved < before / 4
        assert s["pool/decode/prefix_cache_hits"] >= hits_before
    finally:
        llm.close()


@pytest.fixture(scope="module")
def e_p_d_server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "512", "--encode-workers", "1",
                             "--prefill-workers", "1", "--decode-workers", "1",
                             "--served-model-name", "tiny")


def test_serve_1e1p1d_equals_offline(e_p_d_server, tiny_qwen2_vl):
    client = e_p_d_server.openai_client(timeout=120)
    offline = LLM(tiny_qwen2_vl, block_size=4, max_model_len=512)
    for msgs in (user(image_part(data_url(png(img(1, 56, 84)))), text_part("What is it?")),
                 user(text_part("Only words here.")),
                 user(image_part(data_url(png(img(2)))), image_part(data_url(png(img(3, 84)))),
                      text_part("Two."))):
        want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)[0].outputs[0].text
        r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                           max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == want
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=msgs, temperature=0, max_tokens=MAX_TOKENS, stream=True)
            if c.choices)
        assert streamed == want
    h = httpx.get(e_p_d_server.base + "/health").json()
    assert h["status"] == "ok" and set(h["pools"]) == {"encode", "prefill", "decode"}
    wait_for(lambda: e_p_d_server.metric("triptych:kv_transfer_bytes_total") > 0,
             "the prefill worker's report of its KV transfers")


def test_sigterm_with_every_pool_leaves_nothing(e_p_d_server):
    """Runs last for this server: SIGTERM stops P0 and every pool's workers;
    no process (by pid), shared-memory segment or socket dir of any of them remains."""
    import glob
    import re

    from server_fixtures import _children, alive

    sockets = re.findall(r"sockets in (\S+)", e_p_d_server.log_path.read_text())[0]
    procs = sorted(set(e_p_d_server.descendants) | set(_children(e_p_d_server.proc.pid)))
    pids = {str(p) for p in procs} | {str(e_p_d_server.proc.pid)}
    assert len(procs) >= 3
    e_p_d_server.stop(signal.SIGTERM, timeout=60)
    wait_for(lambda: not any(alive(p) for p in procs), "every worker to exit")  # hang guard
    assert not os.path.exists(sockets)
    left = [p for p in glob.glob("/dev/shm/triptych-*") + glob.glob("/tmp/triptych-*")
            if (m := re.match(r"triptych-(\d+)-", os.path.basename(p))) and m.group(1) in pids]
    assert left == []
