"""CURVE helpers (connector/auth.py) as the router's control socket will use them: key
files, their permissions, and an asyncio ROUTER that admits only allowed client keys.
Between processes: tests/test_connector_processes.py::test_curve_keeps_strangers_out."""
from __future__ import annotations

import asyncio
import os

import pytest
import zmq
import zmq.asyncio
from triptych.connector import ConnectorError
from triptych.connector.auth import generate_keys, load_keys, secure_client, secure_server
from triptych.connector.zap import ZapHandler


@pytest.fixture
def keydir(tmp_path):
    d = str(tmp_path / "keys")
    generate_keys(d, ["router", "worker", "stranger"])
    return d


def test_key_files(keydir):
    k = load_keys(keydir, "worker")
    assert len(k.public) == 40 and len(k.secret) == 40
    assert sorted(k.peers) == ["router", "stranger", "worker"]
    assert k.peers["worker"] == k.public
    assert os.stat(os.path.join(keydir, "private")).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(keydir, "private", "worker.key_secret")).st_mode & 0o777 == 0o600
    with pytest.raises(ConnectorError, match="already exists"):
        generate_keys(keydir, ["worker"])
    with pytest.raises(ConnectorError, match="letters, digits"):
        generate_keys(keydir, ["../evil"])
    with pytest.raises(ConnectorError, match="no secret key"):
        load_keys(keydir, "nobody")
    os.chmod(os.path.join(keydir, "private", "worker.key_secret"), 0o644)
    with pytest.raises(ConnectorError, match="not readable by group or others"):
        load_keys(keydir, "worker")


def test_asyncio_router_admits_only_allowed_clients(keydir):
    router, worker, stranger = (load_keys(keydir, n) for n in ("router", "worker", "stranger"))

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        srv = ctx.socket(zmq.ROUTER)
        auth = secure_server(srv, router, [worker.public])  # the stranger is not listed
        port = srv.bind_to_random_port("tcp://127.0.0.1")
        clients = []
        for keys in (stranger, worker):
            c = ctx.socket(zmq.DEALER)
            secure_client(c, keys, router.public)
            c.connect(f"tcp://127.0.0.1:{port}")
            clients.append(c)
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        plain.connect(f"tcp://127.0.0.1:{port}")
        try:
            await plain.send(b"plain")
            await clients[0].send(b"stranger")
            await clients[1].send(b"hello")
            msg = await asyncio.wait_for(srv.recv_multipart(copy=False), 5)
            assert msg[1].bytes == b"hello" and msg[1].get("User-Id") == worker.public.decode()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(srv.recv_multipart(), 1.0)
            await srv.send_multipart([msg[0].bytes, b"reply"])  # encrypted both ways
            assert await asyncio.wait_for(clients[1].recv(), 5) == b"reply"
            # the stranger reached ZAP and was refused (the plain one fails the greeting)
            assert ZapHandler._by_ctx[ctx.underlying].denied >= 1
        finally:
            for s in (srv, plain, *clients):
                s.close(0)
            auth.close()  # stops the handler thread, so term() returns
            assert ctx.underlying not in ZapHandler._by_ctx
            ctx.term()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_two_servers_share_one_context_with_their_own_lists(keydir):
    router, worker, stranger = (load_keys(keydir, n) for n in ("router", "worker", "stranger"))
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    auth_a = secure_server(a, router, [worker.public])
    auth_b = secure_server(b, router, [stranger.public])
    ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in (a, b)]
    pushes = []
    try:
        for port in ports:
            for keys in (worker, stranger):
                p = ctx.socket(zmq.PUSH)
                secure_client(p, keys, router.public)
                p.connect(f"tcp://127.0.0.1:{port}")
                p.send(keys.name.encode())
                pushes.append(p)
        assert a.poll(5000) and a.recv() == b"worker"
        assert b.poll(5000) and b.recv() == b"stranger"
        assert not a.poll(500) and not b.poll(10)
        auth_a.close()  # b keeps its list; the shared handler keeps running
        assert ctx.underlying in ZapHandler._by_ctx
    finally:
        for s in (a, b, *pushes):
            s.close(0)
        auth_a.close()
        auth_b.close()
        ctx.term()
