"""The prefill -> decode KV path between real worker handlers (PrefillWorker, DecodeWorker)
joined by a real shm connector, driven step by step in this process: the decode worker's
blocks hold exactly the bytes the prefill worker computed, decode-side prefix hits are not
sent again, and a worker that gets a bad or unfinished transfer frees what it reserved and
keeps serving."""
from __future__ import annotations

import hashlib

import msgspec
import pytest
import torch
from triptych.decode.worker import DecodeWorker
from triptych.worker import wire
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.worker.loop import WorkerSpec, _receive
from triptych.prefill.worker import PrefillWorker

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _spec(pool: str, model: str, **kw) -> WorkerSpec:
    config = {"model": model, "block_size": BS, "max_model_len": 256, "num_kv_blocks": 64,
              "kv_transfer": "shm", "kv_transfer_timeout": 1.0, **kw}
    return WorkerSpec(worker_id=f"{pool}-0#0", pool=pool, router_address="ipc:///unused",
                      config=config)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pd(request, tiny_qwen2_vl):
    p = PrefillWorker(_spec("prefill", tiny_qwen2_vl, dtype=request.param))
    d = DecodeWorker(_spec("decode", tiny_qwen2_vl, dtype=request.param))
    yield p, d
    p.close()
    d.close()


def _digest(kv_caches: list, block_ids: list[int]) -> str:
    h = hashlib.sha256()
    for k, v in kv_caches:
        for t in (k, v):
            h.update(t[block_ids].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pump(d: DecodeWorker, done, timeout: float = 10.0) -> list:
    """Take data messages until ``done()`` (the ipc socket delivers asynchronously)."""
    import time

    replies, deadline = [], time.monotonic() + timeout
    while True:
        replies += d.on_data()
        if done() or time.monotonic() > deadline:
            return replies
        d.connector.poll_socket().poll(50)


def _transfer(p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int],
              sp: SamplingParams = GREEDY) -> tuple[list[int], str, str, wire.KVReserved]:
    """Reserve on d, prefill on p, move the KV, decode to the end. Returns (tokens, digest
    of p's blocks, digest of d's blocks, the reservation)."""
    (reserved,) = _receive(d, wire.encode(wire.ReserveKV(rid, prompt, sp)))
    assert isinstance(reserved, wire.KVReserved)
    dest = wire.KVDest("decode-0", d.connector.address, reserved.num_blocks,
                       reserved.num_cached_blocks)
    assert _receive(p, wire.encode(wire.AddRequest(rid, prompt, sp, kv_dest=dest))) == []
    tokens: list[int] = []
    p_digest = None
    while p.has_work():
        for m in p.step():
            tokens += [t for o in m.outputs for t in o.new_token_ids]
        handed = p.core.kv.handed_off.get(rid)
        if handed:  # what the prefill side computed, before it is released
            p_digest = _digest(p.core.runner.kv_caches, [b.block_id for b in handed])
        assert p.after_step() == []
        assert d.on_data() == []
    assert _pump(d, lambda: rid in d.core.scheduler.requests) == []
    assert p.sender.settle(10) == []  # the send lanes let go of every block
    assert len(tokens) == 1 and p_digest is not None
    req = d.core.scheduler.requests[rid]
    d_ids = d.core.kv.block_ids(rid)[:reserved.num_blocks]
    d_digest = _digest(d.core.runner.kv_caches, d_ids)
    while d.has_work():
        for m in d.step():
            tokens += [t for o in m.outputs for t in o.new_token_ids]
    assert req.finished and len(tokens) == sp.max_tokens
    return tokens, p_digest, d_digest, reserved


@pytest.mark.parametrize("n_tokens", [3, BS, 4 * BS, 9 * BS + 2],
                         ids=["one block", "exactly one block", "exactly full last block",
                              "many blocks"])
def test_decode_blocks_hold_the_prefill_bytes(pd, n_tokens):
    p, d = pd
    prompt = [(7 * i + n_tokens) % 300 + 1 for i in range(n_tokens)]
    d.core.kv.pool.reset_prefix_cache()
    p.core.kv.pool.reset_prefix_cache()
    tokens, p_digest, d_digest, reserved = _transfer(p, d, f"r{n_tokens}", prompt)
    assert reserved.num_cached_blocks == 0
    assert reserved.num_blocks == -(-n_tokens // BS)
    assert d_digest == p_digest
    # The same tokens as one engine doing both (the prefill worker's core, undisturbed).
    p.core.add_request("colocated", prompt, GREEDY)
    alone = []
    while p.core.has_unfinished_requests():
        alone += [t for o in p.core.step().outputs for t in o.new_token_ids]
    assert tokens == alone
    d.core.kv.check_integrity()
    p.core.kv.check_integrity()
    assert d.core.kv.pool.num_free_blocks == 64 and not p.core.kv.handed_off


def test_decode_side_prefix_hits_are_not_sent_again(pd):
    p, d = pd
    prompt = list(range(1, 6 * BS + 3))
    first, *_ = _transfer(p, d, "a", prompt)
    sent = p.sender.bytes_sent
    second, p_digest, d_digest, reserved = _transfer(p, d, "b", prompt)
    assert first == second
    assert reserved.num_cached_blocks == 6 and reserved.num_blocks == 7
    per_block = (p.sender.bytes_sent - sent)  # only the last, partial block moved
    assert per_block < (sent / 7) * 2


def test_bad_transfers_are_dropped_and_free_their_blocks(pd):
    p, d = pd
    free = d.core.kv.pool.num_free_blocks
    prompt = list(range(100, 100 + 3 * BS))  # nothing of it cached on the decode side
    layout = d.core.runner.kv_caches[0][0]
    L = len(d.core.runner.kv_caches)
    good = torch.zeros(L, 2, 1, *layout.shape[1:], dtype=layout.dtype)
    cases = {  # name -> (header, tensors)
        "unknown request": (wire.KVTransfer("nobody", 0), [good]),
        "wrong block count": (None, [torch.zeros(L, 2, 9, *layout.shape[1:], dtype=layout.dtype)]),
        "wrong layout": (None, [torch.zeros(L, 2, 1, BS, 3, 3, dtype=layout.dtype)]),
        "wrong dtype": (None, [torch.zeros(L, 2, 1, *layout.shape[1:], dtype=torch.float16)]),
        "skipped blocks": ("skip", [good]),
        "final too early": ("final", [good]),
        "two tensors": (None, [good, good]),
    }
    for i, (name, (hdr, tensors)) in enumerate(cases.items()):
        rid = f"bad{i}"
        if name != "unknown request":
            (res,) = _receive(d, wire.encode(wire.ReserveKV(rid, prompt, GREEDY)))
            assert isinstance(res, wire.KVReserved), name
            assert d.core.kv.pool.num_free_blocks == free - 3
        if not isinstance(hdr, wire.KVTransfer):
            hdr = {None: wire.KVTransfer(rid, 0), "skip": wire.KVTransfer(rid, 1),
                   "final": wire.KVTransfer(rid, 0, final=True, first_token=5)}[hdr]
        p.connector.send(d.connector.address, hdr, tensors)
        replies = _pump(d, lambda: d.receiver.num_pending == 0, 2.0)
        if name == "unknown request":
            assert replies == [], name
        else:
            assert [type(r) for r in replies] == [wire.RequestError], name
            assert replies[0].retryable and replies[0].request_id == rid
        assert d.core.kv.pool.num_free_blocks == free, name  # nothing held any more
    # Garbage headers on the data socket: dropped, nothing held, still serving.
    import zmq
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(d.connector.address.split("#")[0])
    for frames in ([b"\xff"], [msgspec.msgpack.encode({"kv": 1})], [b""] * 3):
        raw.send_multipart(frames)
    raw.close(0)
    ctx.term()
    assert _pump(d, lambda: False, 0.3) == []
    tokens, p_digest, d_digest, _ = _transfer(p, d, "after-garbage", prompt)
    assert p_digest == d_digest and len(tokens) == GREEDY.max_tokens
    assert d.core.kv.pool.num_free_blocks == free


def test_a_transfer_that_never_completes_frees_its_blocks(pd):
    import time

    _, d = pd
    free = d.core.kv.pool.num_free_blocks
    (res,) = _receive(d, wire.encode(wire.ReserveKV("stuck", list(range(1, 20)), GREEDY)))
    assert isinstance(res, wire.KVReserved) and d.core.kv.pool.num_free_blocks < free
    assert d.housekeeping(time.monotonic()) == []  # within the lease
    (err,) = d.housekeeping(time.monotonic() + 1.5)  # kv_transfer_timeout = 1 s
    assert isinstance(err, wire.RequestError) and err.retryable and err.request_id == "stuck"
    assert d.core.kv.pool.num_free_blocks == free
    assert d.receiver.num_expired >= 1


def test_a_reservation_without_room_waits_then_holds(pd):
    import time

    _, d = pd
    d.core.kv.pool.reset_prefix_cache()
    hog = [wire.encode(wire.ReserveKV(f"hog{i}", [(97 * i + j) % 500 + 1 for j in range(55)],
                                      GREEDY)) for i in range(5)]
    got = [r for frames in hog for r in _receive(d, frames)]
    assert len(got) == 4  # 4 x 14 blocks fit in 64; the fifth waits for room
    assert d.receiver.num_pending == 5
    d.receiver.cancel("hog0")
    (late,) = d.housekeeping(time.monotonic())
    assert isinstance(late, wire.KVReserved) and late.request_id == "hog4"
    for i in range(1, 5):
        d.receiver.cancel(f"hog{i}")
    assert d.core.kv.pool.num_free_blocks == 64


def test_inproc_is_refused_for_pool_layouts():
    """Pool workers are processes: kv_transfer=inproc could never join them, so the config
    refuses it up front (rather than every worker failing at start)."""
    from triptych.config import EngineConfig

    for pools in ({"decode_workers": 1}, {"prefill_workers": 1, "decode_workers": 1},
                  {"encode_workers": 1, "decode_workers": 2}):
        with pytest.raises(ValueError, match=r"kv_transfer=inproc .* separate processes"):
            EngineConfig(model="unused", kv_transfer="inproc", **pools)
        for kind in ("auto", "shm", "tcp"):
            EngineConfig(model="unused", kv_transfer=kind, **pools)
    EngineConfig(model="unused", kv_transfer="inproc")  # colocated: no data plane to refuse
