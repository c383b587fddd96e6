"""P->D under load (issue 15, point 6): the decode side's lease is renewed while the prefill
side holds the request (every chunk renews it; an empty chunk while it waits), KV leaves in
bounded messages, and a decode peer that stopped taking messages costs the prefill loop one
send timeout, not one per request bound to it. Against the real server: 20 concurrent long
prompts through one prefill and one decode worker with a 2 s lease all complete."""
from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from triptych import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from kv_handoff import HandOff
from server_fixtures import ServerProc, text_part, user


@pytest.fixture(scope="module")
def engines(tiny_qwen2_vl):
    prefill = LLM(tiny_qwen2_vl, block_size=4)
    decode = LLM(tiny_qwen2_vl, block_size=4, num_kv_blocks=256)
    return prefill, decode


def _prompt(llm: LLM, text: str) -> list[int]:
    return llm.processor.process_chat(user(text_part(text))).prompt_token_ids


def test_a_waiting_request_keeps_its_lease(engines):
    prefill, decode = engines
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    link = HandOff(prefill.engine.core, decode.engine.core, timeout_s=2.0)
    try:
        prompt = _prompt(prefill, "a request that waits in the prefill queue")
        reserved = link.reserve("w", prompt, sp, [])
        held = link.receiver._held["w"]
        held.deadline = time.monotonic() - 1.0  # its first lease has run out (not swept yet)
        link.sender.add("w", _dest(link, reserved))
        # the request waits (not scheduled yet): a quarter lease later it is renewed
        assert link.sender.keepalive(time.monotonic()) == []  # too early: nothing sent
        assert link.sender.keepalive(time.monotonic() + 0.6) == [] and link.sender.keepalives == 1
        assert link.sender.settle() == []
        assert link.receive() is None  # the empty chunk arrived, nothing completed
        # the reservation stands (without the renewal it expired here)
        assert link.receiver.expire(time.monotonic()) == []
        assert link.receiver.expire(held.deadline + 0.01) == ["w"]  # a silent sender: gone
        link.sender.cancel("w")
    finally:
        link.close()


def _dest(link: HandOff, reserved):
    from triptych.worker import wire

    return wire.KVDest("decode", link.rx.address, reserved.num_blocks, reserved.num_cached_blocks)


def test_kv_leaves_in_bounded_messages(engines, monkeypatch):
    from triptych.prefill import kv_sender

    prefill, decode = engines
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = _prompt(prefill, "Tell me about the river, the hills and the old mill. " * 4)
    ref = prefill.generate([prompt], sp, use_tqdm=False)[0]
    link = HandOff(prefill.engine.core, decode.engine.core)
    monkeypatch.setattr(kv_sender, "MAX_KV_MESSAGE_BYTES", 1)  # one block per message
    sizes: list[int] = []
    on_transfer = link.receiver.on_transfer

    def counting(hdr, data, seconds=0.0):
        sizes.append(data.shape[2])
        return on_transfer(hdr, data, seconds)

    link.receiver.on_transfer = counting
    try:
        reserved = link.reserve("m", prompt, sp, [])
        first = link.prefill_and_send("m", prompt, sp, [], reserved)
        req = link.receive()
        assert req is not None and req.output_token_ids == [first]
        to_send = reserved.num_blocks - reserved.num_cached_blocks
        assert to_send > 3 and max(sizes) == 1 and sum(sizes) == to_send
        while decode.engine.has_unfinished_requests():
            decode.engine.core.step()
        assert req.output_token_ids == ref.outputs[0].token_ids
    finally:
        link.close()


def test_a_gone_decode_peer_costs_one_send_timeout(engines):
    from server_fixtures import free_port
    from triptych.connector import make_connector
    from triptych.worker import wire

    prefill, decode = engines
    link = HandOff(prefill.engine.core, decode.engine.core)
    tx = make_connector("tcp", name="pd-load-tx", header_type=wire.DataMsg,
                        send_timeout_ms=300)
    link.sender.lanes.connector = tx
    address = f"tcp://127.0.0.1:{free_port()}"  # a decode worker killed with -9: nobody there
    calls = []
    send = tx.send

    def counting(*a, **kw):
        calls.append(a[0])
        return send(*a, **kw)

    tx.send = counting
    try:
        for rid in ("g1", "g2", "g3"):
            link.sender.add(rid, wire.KVDest("decode", address, 4, 0))
        # the loop only queues: nothing failed yet, nothing waited for the peer
        assert link.sender.keepalive(time.monotonic() + 100) == []
        failed = link.sender.settle(10)
        assert failed == ["g1", "g2", "g3"]  # every request bound to it fails (retryable)
        assert calls == [address]  # but only the first waited for the peer
    finally:
        tx.close()
        link.close()


def test_20_concurrent_long_pd_prompts_keep_their_leases(tiny_qwen2_vl, tmp_path):
    s = ServerProc(tiny_qwen2_vl, tmp_path / "serve.log", "--block-size", "16",
                   "--max-model-len", "4096", "--prefill-workers", "1", "--decode-workers", "1",
                   "--kv-transfer-timeout", "2", "--max-num-batched-tokens", "512",
                   "--served-model-name", "tiny")
    try:
        def one(i: int) -> httpx.Response:
            text = f"Story {i}: " + "the fox ran over the hill and back again. " * 120
            return httpx.post(s.base + "/v1/chat/completions", timeout=600,  # hang guard
                              json={"model": "tiny", "max_tokens": 2,
                                    "messages": user(text_part(text))})

        with ThreadPoolExecutor(20) as pool:
            responses = list(pool.map(one, range(20)))
        assert [r.status_code for r in responses] == [200] * 20, responses[0].text
        assert all(r.json()["usage"]["prompt_tokens"] > 1000 for r in responses)
        log = s.log_path.read_text()
        assert "did not complete in" not in log  # no lease ran out
        assert s.metric("triptych:request_migrations_total") == 0
    finally:
        s.stop(signal.SIGTERM, timeout=60)
        s.cleanup_descendants()
