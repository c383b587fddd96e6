"""The connector between real processes: identical bytes over shm and tcp for KV and
embedding transfers, CURVE keeping strangers out, and nothing left behind after kill -9.

The peer side is tests/connector_peer.py, started with subprocess (nothing pickled).
"""
from __future__ import annotations

import glob
import importlib.util
import math
import os
import secrets
import socket
import tempfile
import time

import msgspec
import pytest
import torch
import zmq
from triptych.connector import (
    BadMessage,
    ConnectorError,
    SendTimeout,
    cleanup_stale,
    make_connector,
)
from triptych.connector.auth import generate_keys, load_keys
from triptych.connector.envelope import ENCODER, Envelope, TensorSpec

torch.set_num_threads(1)


def _load_peer_module():
    # tests/ is not a package (pytest --import-mode=importlib): load the helper by path.
    path = os.path.join(os.path.dirname(__file__), "connector_peer.py")
    spec = importlib.util.spec_from_file_location("connector_peer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P = _load_peer_module()


@pytest.fixture
def prefix():
    """A segment/ipc-dir prefix of this test only; nothing with it may remain afterwards."""
    p = f"triptych-t{secrets.token_hex(3)}-"
    yield p
    time.sleep(0.05)
    left = cleanup_stale(p)
    mine = glob.glob(f"/dev/shm/{p}*") + glob.glob(os.path.join(tempfile.gettempdir(), p + "*"))
    assert not left and not mine, f"leftovers: {left + mine}"


def kv_transfer(num_tokens: int, dtype: torch.dtype, seed: int, block_size: int = 16,
                num_layers: int = 3, num_kv_heads: int = 2, head_dim: int = 32) -> list:
    """K and V of every layer for the blocks of a prompt of ``num_tokens``: per tensor
    [num_blocks, block_size, num_kv_heads, head_dim], filled with random *bit patterns*
    (NaN payloads included): the bytes must survive, not just the values."""
    num_blocks = math.ceil(num_tokens / block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    g = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * dtype.itemsize
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)
            .view(shape) for _ in range(2 * num_layers)]


def embeddings(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).to(dtype)


# (label, prompt tokens): one block, a prompt that exactly fills its last block, many blocks
KV_CASES = [("one-block", 5), ("full-last-block", 48), ("many-blocks", 1000)]


def _expect(p: P.Peer, kind: str, header: msgspec.Struct, tensors: list) -> None:
    line = p.next()
    assert line.get("kind") == kind and "error" not in line, line
    assert line["header"] == msgspec.to_builtins(header)
    assert line["tensors"] == [P.digest(t) for t in tensors], f"bytes differ over {kind}"
    if kind == "shm":  # the receiver unlinked the segment as it took it
        assert not _segments(line["prefix"], os.getpid())


def test_identical_bytes_between_processes(prefix):
    peer = P.Peer("recv", "--kinds", "shm,tcp", "--prefix", prefix)
    senders = {}
    try:
        addresses = peer.next()["addresses"]
        senders = {k: make_connector(k, name=f"s-{k}", header_type=P.Header, shm_prefix=prefix)
                   for k in ("shm", "tcp")}
        for kind, conn in senders.items():
            seed = 0
            for dtype in (torch.bfloat16, torch.float32):
                for label, num_tokens in KV_CASES:
                    seed += 1
                    kv = kv_transfer(num_tokens, dtype, seed)
                    h = P.KVTransfer(f"{label}-{dtype}", list(range(kv[0].shape[0])), 3)
                    n = conn.send(addresses[kind], h, kv)
                    assert n >= sum(t.numel() * t.element_size() for t in kv)
                    _expect(peer, kind, h, kv)
                for rows in (1, 300):
                    seed += 1
                    emb = embeddings(rows, 256, dtype, seed)
                    h = P.Embeddings(f"img-{rows}-{dtype}")
                    conn.send(addresses[kind], h, [emb])
                    _expect(peer, kind, h, [emb])
            assert conn.stats.sent["KVTransfer"].messages == 6
            assert conn.stats.sent["Embeddings"].messages == 4
        senders["tcp"].send(addresses["tcp"], P.Done())
        assert peer.next()["header"] == {"type": "done"}
        assert peer.proc.wait(timeout=20) == 0  # it closed its endpoints: the fixture checks
    finally:
        for c in senders.values():
            c.close()
        peer.kill()


def test_inproc_identical_bytes_in_one_process():
    rx = make_connector("inproc", name="sum-rx", header_type=P.Header)
    tx = make_connector("inproc", name="sum-tx", header_type=P.Header)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            for label, num_tokens in KV_CASES:
                kv = kv_transfer(num_tokens, dtype, seed=num_tokens)
                tx.send(rx.address, P.KVTransfer(label, [0], 3), kv)
                msg = rx.recv(5000)
                assert [P.digest(t) for t in msg.tensors] == [P.digest(t) for t in kv]
            emb = embeddings(300, 256, dtype, seed=7)
            tx.send(rx.address, P.Embeddings("img"), [emb])
            assert P.digest(rx.recv(5000).tensors[0]) == P.digest(emb)
    finally:
        tx.close()
        rx.close()


def test_curve_keeps_strangers_out(tmp_path):
    keydir = str(tmp_path / "keys")
    generate_keys(keydir, ["recv", "good", "stranger"])
    # The receiver admits only "good" (a valid keypair of the cluster, "stranger", is not
    # on its list: an unknown client key).
    peer = P.Peer("recv", "--kinds", "tcp", "--keys", keydir, "--key-name", "recv",
                  "--allow", "good")
    conns = []
    try:
        addr = peer.next()["addresses"]["tcp"]
        assert "#curve=" in addr and addr.startswith("tcp://127.0.0.1:")
        good = make_connector("tcp", name="good", header_type=P.Header,
                              keys=load_keys(keydir, "good"))
        stranger = make_connector("tcp", name="stranger", header_type=P.Header,
                                  keys=load_keys(keydir, "stranger"))
        plain = make_connector("tcp", name="plain", header_type=P.Header)
        conns += [good, stranger, plain]
        t = torch.arange(1024, dtype=torch.float32)

        good.send(addr, P.Embeddings("hello"), [t])
        line = peer.next()
        assert line["header"]["mm_hash"] == "hello"
        assert line["peer_key"] == load_keys(keydir, "good").public.decode()

        with pytest.raises(SendTimeout):  # handshake refused by ZAP: nothing is queued
            stranger.send(addr, P.Embeddings("from-stranger"), [t], timeout_ms=1500)
        with pytest.raises(ConnectorError, match="requires CURVE"):
            plain.send(addr, P.Embeddings("plaintext"), [t])

        # Below our API: a raw ZMQ peer with no key (NULL mechanism) that queues a
        # well-formed message, a raw CURVE peer with a random key, and raw TCP garbage.
        host_port = addr.split("#")[0]
        env = ENCODER.encode(Envelope(msgspec.Raw(ENCODER.encode(P.Embeddings("injected"))),
                                      [TensorSpec("float32", [4], 16)], time.time()))
        ctx = zmq.Context()
        try:
            raw = ctx.socket(zmq.PUSH)
            raw.connect(host_port)
            raw.send_multipart([env, b"\0" * 16])  # queued until a handshake that never ends
            curve = ctx.socket(zmq.PUSH)
            pub, sec = zmq.curve_keypair()
            curve.curve_publickey, curve.curve_secretkey = pub, sec
            curve.curve_serverkey = load_keys(keydir, "recv").public
            curve.connect(host_port)
            curve.send_multipart([env, b"\0" * 16])
            host, port = host_port.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + os.urandom(4096))
            time.sleep(1.5)  # room for any of them to arrive, were the door open
        finally:
            ctx.destroy(linger=0)
        with pytest.raises(TimeoutError):
            peer.next(timeout=0.2)  # nothing arrived, not even an error

        good.send(addr, P.Embeddings("after"), [t])  # the receiver is healthy
        assert peer.next()["header"]["mm_hash"] == "after"
        good.send(addr, P.Done())
        assert peer.next()["header"] == {"type": "done"}
        assert peer.proc.wait(timeout=20) == 0
    finally:
        for c in conns:
            c.close()
        peer.kill()


def _segments(prefix: str, pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/{prefix}{pid}-*")


def _ipc_dirs(prefix: str, pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}{pid}-ipc-*"))


def wait_reaped(sender) -> bool:
    """The reaper counts a segment just after unlinking it: wait for the count."""
    t0 = time.monotonic()
    while sender.stats.reaped_segments != 1 and time.monotonic() - t0 < 60:  # hang guard
        time.sleep(0.01)
    return sender.stats.reaped_segments == 1


def test_receiver_killed_before_reading_leaks_nothing(prefix):
    peer = P.Peer("recv", "--kinds", "shm", "--prefix", prefix, "--no-read")
    sender = None
    try:
        line = peer.next()
        addr, child = line["addresses"]["shm"], line["pid"]
        sender = make_connector("shm", name="s", header_type=P.Header, shm_prefix=prefix,
                                segment_ttl_s=1.0)
        sender.send(addr, P.Embeddings("never-read"), [torch.ones(64, 64)])
        # Written once, handle delivered (counted: the 1 s TTL may already have reaped the
        # segment itself if this process stalled, which a loaded box does).
        assert sender.stats.sent["Embeddings"].messages == 1
        assert len(_segments(prefix, os.getpid())) == 1 or wait_reaped(sender)
        peer.kill()  # SIGKILL, reaped
        dead_dirs = _ipc_dirs(prefix, child)
        assert len(dead_dirs) == 1  # kill -9 left the receiver's socket directory
        t0 = time.monotonic()
        while _segments(prefix, os.getpid()) and time.monotonic() - t0 < 60:  # hang guard
            time.sleep(0.05)
        assert not _segments(prefix, os.getpid()), "the sender did not reap its segment"
        assert sender.stats.reaped_segments == 1
        # The supervisor's sweep removes the dead receiver's ipc socket directory.
        assert cleanup_stale(prefix) == dead_dirs
        assert not _ipc_dirs(prefix, child)
        sender.close()
        assert not glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*"))
    finally:
        if sender is not None:
            sender.close()
        peer.kill()


def test_cleanup_stale_removes_a_dead_senders_segments(prefix):
    recv = make_connector("shm", name="r", header_type=P.Header, shm_prefix=prefix)
    good = make_connector("shm", name="g", header_type=P.Header, shm_prefix=prefix)
    peer = P.Peer("send", "--kind", "shm", "--to", recv.address, "--prefix", prefix)
    try:
        line = peer.next()
        child = line["pid"]
        assert len(_segments(prefix, child)) == 1 and _ipc_dirs(prefix, child)
        assert cleanup_stale(prefix) == []  # its owner is alive: untouched
        # The handle has reached the receiver's queue (not read: poll only), so the kill
        # cannot lose it in the dying sender's send buffer, however loaded the box.
        assert recv.poll_socket().poll(60_000, zmq.POLLIN)
        peer.kill()  # SIGKILL while its segment waits unread
        leftovers = sorted(_segments(prefix, child) + _ipc_dirs(prefix, child))
        assert sorted(cleanup_stale(prefix)) == leftovers
        assert not _segments(prefix, child) and not _ipc_dirs(prefix, child)
        # The handle is still queued: reading it is a clean error for that message only.
        with pytest.raises(BadMessage, match="gone"):
            recv.recv(5000)
        t = torch.arange(10, dtype=torch.float32)
        good.send(recv.address, P.Embeddings("next"), [t])
        msg = recv.recv(5000)
        assert msg is not None and torch.equal(msg.tensors[0], t)
    finally:
        peer.kill()
        good.close()
        recv.close()
