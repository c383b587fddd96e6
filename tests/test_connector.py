"""The connector in one process: inproc by reference, every kind of garbage a peer can send
(each a clean error for that message, the next good message fine), bounds, refusals and
cleanup. Cross-process behaviour: tests/test_connector_processes.py."""
from __future__ import annotations

import glob
import os
import secrets
import tempfile
import time

import msgspec
import pytest
import torch
import zmq
from triptych.connector import (
    BadMessage,
    ConnectorError,
    Limits,
    SendTimeout,
    cleanup_stale,
    make_connector,
    resolve_kind,
)
from triptych.connector import segments as seg
from triptych.connector.envelope import ENCODER, Envelope, TensorSpec
from triptych.connector.inproc import _context

torch.set_num_threads(1)


class KVTransfer(msgspec.Struct, tag="kv"):
    request_id: str
    block_ids: list[int]


class Embeddings(msgspec.Struct, tag="emb"):
    mm_hash: str


class Evil(msgspec.Struct, tag="evil"):  # a type no receiver accepts
    code: str


Header = KVTransfer | Embeddings


@pytest.fixture
def prefix():
    p = f"triptych-t{secrets.token_hex(3)}-"
    yield p
    mine = glob.glob(f"/dev/shm/{p}*") + glob.glob(os.path.join(tempfile.gettempdir(), p + "*"))
    assert not mine, f"leftovers: {mine}"


@pytest.fixture(params=["inproc", "shm", "tcp"])
def pair(request, prefix):
    """(receiver, sender) of one kind."""
    name = secrets.token_hex(4)
    limits = Limits(max_message_bytes=1 << 20, max_tensors=8)
    rx = make_connector(request.param, name=f"rx-{name}", header_type=Header, limits=limits,
                        shm_prefix=prefix)
    tx = make_connector(request.param, name=f"tx-{name}", header_type=Header, limits=limits,
                        shm_prefix=prefix)
    yield rx, tx
    tx.close()
    rx.close()
    if rx.kind == "shm":
        assert not os.path.exists(rx.address.removeprefix("ipc://"))


def _env(header: msgspec.Struct, specs: list[TensorSpec], **fields) -> bytes:
    return ENCODER.encode(Envelope(msgspec.Raw(ENCODER.encode(header)), specs, time.time(),
                                   **fields))


def _raw_push(rx):
    ctx = _context() if rx.kind == "inproc" else zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(rx.address.split("#")[0])
    return ctx, s


def _good_roundtrip(rx, tx, tag: str) -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    tx.send(rx.address, Embeddings(tag), [t])
    msg = rx.recv(5000)
    assert msg is not None and msg.header == Embeddings(tag) and torch.equal(msg.tensors[0], t)


def test_roundtrip_and_stats(pair):
    rx, tx = pair
    k = torch.randn(2, 16, 2, 8).to(torch.bfloat16)
    v = torch.randn(2, 16, 2, 8).to(torch.bfloat16)
    n = tx.send(rx.address, KVTransfer("r1", [4, 7]), [k, v])
    msg = rx.recv(5000)
    assert msg.header == KVTransfer("r1", [4, 7]) and msg.nbytes == 2 * k.numel() * 2
    assert torch.equal(msg.tensors[0], k) and torch.equal(msg.tensors[1], v)
    assert msg.tensors[0].dtype == torch.bfloat16 and 0 <= msg.seconds < 5
    assert n > msg.nbytes
    if rx.kind != "inproc":  # received tensors are the receiver's to change in place
        msg.tensors[0].mul_(2)
        assert torch.equal(msg.tensors[0], k * 2) and not torch.equal(k, k * 2)
    assert tx.stats.sent["KVTransfer"].bytes == n and tx.stats.sent["KVTransfer"].messages == 1
    assert rx.stats.received["KVTransfer"].bytes == 2 * k.numel() * 2
    assert rx.recv(0) is None  # exactly one message
    _good_roundtrip(rx, tx, "again")


def test_inproc_passes_tensors_by_reference():
    rx = make_connector("inproc", name="by-ref", header_type=Header)
    tx = make_connector("inproc", name="by-ref-tx", header_type=Header)
    try:
        t = torch.randn(5, 7)
        tx.send(rx.address, Embeddings("h"), [t])
        assert rx.poll_socket().poll(1000)  # pollable like the other transports
        msg = rx.recv(0)
        assert msg.tensors[0] is t and msg.header == Embeddings("h")
        with pytest.raises(ConnectorError, match="already exists"):
            make_connector("inproc", name="by-ref", header_type=Header)
        with pytest.raises(ConnectorError, match="no inproc endpoint"):
            tx.send("inproc://triptych-nobody", Embeddings("h"), [t])
    finally:
        tx.close()
        rx.close()


def test_garbage_each_a_clean_error_then_the_next_message_works(pair):
    rx, tx = pair
    ctx, raw = _raw_push(rx)
    ok = [TensorSpec("float32", [4], 16)]
    tensor_frames = [b"\0" * 16] if rx.kind == "tcp" else []
    cases = [
        ("undecodable envelope", [b"\xc1 not msgpack"]),
        ("undecodable envelope", [ENCODER.encode({"header": 1, "x": []})]),
        ("undecodable header", [_env(Evil("rm -rf"), [])]),
        ("unsupported tensor dtype", [_env(Embeddings("d"), [TensorSpec("object", [1], 8)])]),
        ("does not match its dtype", [_env(Embeddings("s"), [TensorSpec("float32", [4], 8)])]),
        # math.prod of a forged shape must not wrap to 0 and "match" an empty buffer
        ("does not match its dtype", [_env(Embeddings("w"),
                                           [TensorSpec("uint8", [2**32, 2**32], 0)])]),
        ("bad tensor shape", [_env(Embeddings("n"), [TensorSpec("float32", [-1, -4], 16)])]),
        ("message over", [_env(Embeddings("big"), [TensorSpec("uint8", [2 << 20], 2 << 20)])]),
        ("tensors in one message", [_env(Embeddings("many"), ok * 9)]),
        ("too many frames", [_env(Embeddings("f"), ok)] + [b"\0" * 16] * 12),
    ]
    if rx.kind == "tcp":
        cases += [
            ("wrong frame count", [_env(Embeddings("c"), ok * 2), b"\0" * 16]),
            ("wrong frame count", [_env(Embeddings("c"), ok)]),
            ("frame of the wrong size", [_env(Embeddings("z"), ok), b"\0" * 15]),
            ("names a segment", [_env(Embeddings("x"), ok, ref=3)] + tensor_frames),
        ]
    else:
        cases.append(("wrong frame count", [_env(Embeddings("c"), ok), b"\0" * 16]))
    if rx.kind == "inproc":
        cases.append(("no stashed tensors", [_env(Embeddings("r"), ok, ref=424242)]))
    for reason, frames in cases:
        raw.send_multipart(frames)
        with pytest.raises(BadMessage, match=reason) as e:
            rx.recv(5000)
        if reason in ("unsupported tensor dtype", "frame of the wrong size"):
            assert e.value.header is not None  # past the header: the caller can fail it
        _good_roundtrip(rx, tx, reason)
    assert rx.stats.bad_messages == len(cases)
    raw.close()
    if rx.kind != "inproc":
        ctx.term()


def test_forged_shm_handles(prefix):
    rx = make_connector("shm", name="rx", header_type=Header, shm_prefix=prefix)
    tx = make_connector("shm", name="tx", header_type=Header, shm_prefix=prefix)
    ctx, raw = _raw_push(rx)
    decoy = f"/dev/shm/{prefix}decoy"
    try:
        with open(decoy, "wb") as f:
            f.write(b"\0" * 64)
        os.chmod(decoy, 0o600)
        ok = [TensorSpec("float32", [4], 16)]

        def real_segment(size: int = 64) -> str:
            name = f"{prefix}{os.getpid()}-{seg.pid_namespace()}-0123abcd-{secrets.token_hex(8)}"
            seg.write_segment(f"/dev/shm/{name}", [], [], size)
            return name

        for name in ["../../etc/passwd", f"{prefix}decoy", "/dev/shm/x",
                     f"triptych-other-{os.getpid()}-0123abcd-1", f"{prefix}1-XYZ-1"]:
            raw.send(_env(Embeddings("n"), ok, segment=name, segment_size=64))
            with pytest.raises(BadMessage, match="bad shared-memory segment name"):
                rx.recv(5000)
        assert os.path.getsize(decoy) == 64  # never touched
        for specs, size, reason in [
            ([TensorSpec("float32", [4], 16, 128)], 64, "outside the shared-memory segment"),
            ([TensorSpec("float32", [32], 128, 0)], 64, "outside the shared-memory segment"),
            ([TensorSpec("float32", [4], 16, 2**62)], 64, "outside the shared-memory segment"),
            (ok, 4096, "size does not match"),
        ]:
            name = real_segment()
            raw.send(_env(Embeddings("o"), specs, segment=name, segment_size=size))
            with pytest.raises(BadMessage, match=reason):
                rx.recv(5000)
            assert not os.path.exists(f"/dev/shm/{name}")  # consumed: freed now, not at TTL
        raw.send(_env(Embeddings("m"), ok))  # tensors announced, no segment
        with pytest.raises(BadMessage, match="bad shared-memory segment name"):
            rx.recv(5000)
        gone = f"{prefix}{os.getpid()}-{seg.pid_namespace()}-0123abcd-00000000deadbeef"
        raw.send(_env(Embeddings("g"), ok, segment=gone,
                      segment_size=64))
        with pytest.raises(BadMessage, match="gone"):
            rx.recv(5000)
        _good_roundtrip(rx, tx, "still fine")
    finally:
        os.unlink(decoy)
        raw.close()
        ctx.term()
        tx.close()
        rx.close()


def test_oversize_tcp_frame_is_dropped_by_zmq():
    limits = Limits(max_message_bytes=1 << 16)
    rx = make_connector("tcp", name="rx", header_type=Header, limits=limits)
    tx = make_connector("tcp", name="tx", header_type=Header, limits=limits)
    ctx, raw = _raw_push(rx)
    try:
        # over ZMQ's per-frame bound (the larger of the message and header limits)
        raw.send_multipart([_env(Embeddings("huge"), [TensorSpec("uint8", [4 << 20], 4 << 20)]),
                            b"\0" * (4 << 20)])
        assert rx.recv(500) is None  # never buffered for us; that peer was disconnected
        with pytest.raises(ConnectorError, match="message over"):  # checked at the sender too
            tx.send(rx.address, Embeddings("big"), [torch.zeros(1 << 15)])
        _good_roundtrip(rx, tx, "fine")
    finally:
        raw.close()
        ctx.term()
        tx.close()
        rx.close()


def test_send_timeouts_are_bounded_and_leak_nothing(prefix):
    tx = make_connector("shm", name="tx", header_type=Header, shm_prefix=prefix)
    rx = make_connector("shm", name="rx", header_type=Header, shm_prefix=prefix)
    tcp = make_connector("tcp", name="tcp", header_type=Header)
    try:
        gone = rx.address
        rx.close()  # its socket file and directory are gone
        assert not os.path.exists(gone.removeprefix("ipc://"))
        t0 = time.monotonic()
        with pytest.raises(SendTimeout):  # SendTimeout, not a hang: the bound holds
            tx.send(gone, Embeddings("x"), [torch.ones(100)], timeout_ms=300)
        assert time.monotonic() - t0 < 30  # a hang guard, not a speed claim
        assert not glob.glob(f"/dev/shm/{prefix}*")  # the unsent segment was unlinked
        with socket_port() as port, pytest.raises(SendTimeout):  # nobody listens there
            tcp.send(f"tcp://127.0.0.1:{port}", Embeddings("x"), [torch.ones(3)],
                     timeout_ms=300)
    finally:
        tcp.close()
        tx.close()


class socket_port:
    """A free loopback port (bound then released)."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass


def test_tcp_is_never_open_by_default():
    with pytest.raises(ConnectorError, match="binds loopback only"):
        make_connector("tcp", name="x", header_type=Header, bind_host="0.0.0.0")
    with pytest.raises(ConnectorError, match="binds loopback only"):
        make_connector("tcp", name="x", header_type=Header, bind_host="10.1.2.3")
    tx = make_connector("tcp", name="x", header_type=Header)
    try:
        assert tx.address.startswith("tcp://127.0.0.1:")
        with pytest.raises(ConnectorError, match="refusing plaintext"):
            tx.send("tcp://10.1.2.3:5555", Embeddings("x"))
        with pytest.raises(ConnectorError, match="not a tcp endpoint"):
            tx.send("ipc:///tmp/x", Embeddings("x"))
    finally:
        tx.close()


def test_cleanup_stale_spares_the_living(prefix):
    live = make_connector("shm", name="live", header_type=Header, shm_prefix=prefix)
    dead_pid = _dead_pid()
    ns = seg.pid_namespace()
    legacy = os.path.join(tempfile.gettempdir(), f"{prefix}{dead_pid}-ipc-x")
    os.makedirs(legacy, mode=0o700)  # no owner lock (an older version's): judged by pid
    os.utime(legacy, (time.time() - 3600,) * 2)  # once old enough (connector/owner.py)
    other = os.path.join(tempfile.gettempdir(), f"{prefix}{dead_pid}-someone-elses")
    os.makedirs(other, mode=0o700)  # not a socket dir of ours: never judged
    token = "00000000deadbeef"
    dead = f"{prefix}{dead_pid}-{ns}-0123abcd-{token}"
    kept = [f"{prefix}{os.getpid()}-{ns}-0123abcd-{token}",  # alive
            f"{prefix}{dead_pid}-{ns + 1}-0123abcd-{token}",  # a sibling container's
            f"{prefix}{dead_pid}-1234-{ns}-{token}"]  # another kind (the ring's form)
    for name in [dead, *kept]:
        seg.write_segment(f"/dev/shm/{name}", [], [], 64)
    try:
        removed = cleanup_stale(prefix)
        assert sorted(removed) == sorted([
            f"/dev/shm/{dead}",
            os.path.join(tempfile.gettempdir(), f"{prefix}{dead_pid}-ipc-x")])
        assert all(os.path.exists(f"/dev/shm/{n}") for n in kept)
        assert os.path.exists(live.address.removeprefix("ipc://")) and os.path.isdir(other)
    finally:
        os.rmdir(other)
        for n in kept:
            os.unlink(f"/dev/shm/{n}")
        live.close()


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def test_resolve_kind():
    assert resolve_kind("auto", same_host=True) == "shm"
    assert resolve_kind("auto", same_host=False) == "tcp"
    assert resolve_kind("auto", same_host=True, same_process=True) == "inproc"
    assert resolve_kind("tcp", same_host=True) == "tcp"
    for bad in [("shm", False, False), ("inproc", True, False), ("nccl", True, True)]:
        with pytest.raises(ValueError):
            resolve_kind(bad[0], same_host=bad[1], same_process=bad[2])


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_send_returns_only_when_the_tensors_may_be_reused(kind, prefix):
    """The caller overwrites its tensors the moment send() returns; the receiver must still
    get what was sent (a small last frame must not end the wait early)."""
    rx = make_connector(kind, name="rx", header_type=Header, shm_prefix=prefix)
    tx = make_connector(kind, name="tx", header_type=Header, shm_prefix=prefix)
    try:
        big, small = torch.ones(4 << 20), torch.ones(3)
        for i in range(3):
            tx.send(rx.address, Embeddings(str(i)), [big, small])
            big.fill_(-1.0)  # reuse the buffer at once
            msg = rx.recv(10000)
            assert msg is not None and bool((msg.tensors[0] == 1).all())
            big.fill_(1.0)
    finally:
        tx.close()
        rx.close()
