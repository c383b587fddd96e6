"""KV sends never block the prefill loop (issue 15, point 6): a prefill worker whose KV for
request A goes to a decode worker killed with -9 (a real process, gone) still prefills,
hands over and lets another decode worker finish request B, while A's send is still
waiting inside its peer's lane; B's greedy tokens equal HF transformers'. A's message is
not lost: the peer coming back (a new endpoint on its address) takes it; its blocks stay
pinned until then."""
from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from triptych.decode.worker import DecodeWorker
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.prefill.worker import PrefillWorker
from triptych.worker import wire
from triptych.worker.loop import WorkerSpec, _receive

sys.path.insert(0, os.path.dirname(__file__))
import connector_peer

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _spec(pool: str, model: str) -> WorkerSpec:
    config = {"model": model, "block_size": BS, "max_model_len": 256, "num_kv_blocks": 64,
              "kv_transfer": "tcp", "kv_transfer_timeout": 30.0}
    return WorkerSpec(worker_id=f"{pool}-0#0", pool=pool, router_address="ipc:///unused",
                      config=config)


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout  # hang guard
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def killed_peer_address():
    peer = connector_peer.Peer("recv", "--kinds", "tcp", "--prefix", "lanes-")
    try:
        address = peer.next()["addresses"]["tcp"]
    finally:
        peer.kill()  # SIGKILL: a decode worker killed with -9
    return address


def test_a_killed_decode_peer_does_not_stall_other_requests(tiny_qwen2_vl, killed_peer_address):
    from triptych.connector import make_connector
    from triptych.models.hf_oracle import hf_greedy, load_hf_model

    p = PrefillWorker(_spec("prefill", tiny_qwen2_vl))
    d = DecodeWorker(_spec("decode", tiny_qwen2_vl))
    back = None
    p.connector.send_timeout_ms = 600_000  # hang guard: A waits until its peer is back
    in_send, returned = threading.Event(), threading.Event()
    send = p.connector.send

    def watched(peer, header, *a, **kw):
        to_dead = peer == killed_peer_address
        if to_dead:
            in_send.set()
        try:
            return send(peer, header, *a, **kw)
        finally:
            if to_dead:
                returned.set()

    p.connector.send = watched
    try:
        prompt_a = [(5 * i) % 300 + 1 for i in range(4 * BS + 1)]
        prompt_b = [(7 * i) % 300 + 2 for i in range(3 * BS + 2)]
        dest_a = wire.KVDest("decode-9", killed_peer_address, 5, 0)
        assert _receive(p, wire.encode(wire.AddRequest("A", prompt_a, GREEDY,
                                                       kv_dest=dest_a))) == []
        (reserved,) = _receive(d, wire.encode(wire.ReserveKV("B", prompt_b, GREEDY)))
        dest_b = wire.KVDest("decode-0", d.connector.address, reserved.num_blocks,
                             reserved.num_cached_blocks)
        assert _receive(p, wire.encode(wire.AddRequest("B", prompt_b, GREEDY,
                                                       kv_dest=dest_b))) == []
        tokens_b: list[int] = []
        replies: list = []
        deadline = time.monotonic() + 120  # hang guard
        while len(tokens_b) < GREEDY.max_tokens:  # the first from p, the rest from d
            assert time.monotonic() < deadline, "B did not finish"
            # the prefill worker's loop round (worker/loop.py): step, after_step, housekeeping
            if p.has_work():
                for m in p.step():
                    tokens_b += [t for o in m.outputs if o.request_id == "B"
                                 for t in o.new_token_ids]
                replies += p.after_step()
            replies += p.housekeeping(time.monotonic())
            replies += d.on_data()
            if d.has_work():
                for m in d.step():
                    tokens_b += [t for o in m.outputs if o.request_id == "B"
                                 for t in o.new_token_ids]
            d.connector.poll_socket().poll(10)
        # B is done while A's send still waits for its peer: the loop never waited on it
        assert in_send.is_set() and not returned.is_set()
        assert replies == []  # nothing failed, A is not given up on
        assert "A" in p.sender._out and p.sender._out["A"].jobs
        assert p.core.kv.pool.num_free_blocks < 64 and "A" not in p.core.kv.handed_off
        hf = load_hf_model(tiny_qwen2_vl)
        oracle, _ = hf_greedy(hf, SimpleNamespace(prompt_token_ids=prompt_b, mm_items=[]),
                              GREEDY.max_tokens)
        assert tokens_b == oracle
        # the peer comes back on its address: A's pending messages arrive, in order
        port = int(killed_peer_address.rsplit(":", 1)[1])
        back = make_connector("tcp", name="lanes-back", header_type=wire.DataMsg, port=port)
        got = []
        while not got or not got[-1].final:
            msg = back.recv(60_000)  # hang guard
            assert msg is not None, "A's KV never arrived"
            got.append(msg.header)
        assert [h.request_id for h in got] == ["A"] * len(got) and got[-1].first_token >= 0
        _wait(lambda: (p.housekeeping(time.monotonic()), "A" not in p.sender._out)[1],
              "A's transfer to be taken back")
        assert p.sender.transfers == 2
        assert p.core.kv.pool.num_free_blocks == 64  # every pin let go
        p.core.kv.check_integrity()
    finally:
        p.close()
        d.close()
        if back is not None:
            back.close()
