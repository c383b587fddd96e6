"""A connector peer in its own process, for tests/test_connector_processes.py.

    python tests/connector_peer.py recv --kinds shm,tcp --prefix P [--keys DIR --key-name B]
        [--no-read] [--deadline S]
    python tests/connector_peer.py send --kind shm --to ADDR --prefix P [--deadline S]

It speaks JSON lines on stdout: first ``{"addresses": {...}}`` (recv) or ``{"sent": ...}``
(send), then (recv) one line per message: the header and, per tensor, dtype, shape and the
sha256 of its bytes, or the error. It exits on a ``Done`` header, at the deadline, or when
its parent dies. Also imported by the tests (``load()``) for the header types and ``Peer``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec


class KVTransfer(msgspec.Struct, tag="kv"):
    request_id: str  # the request whose KV this is
    block_ids: list[int]  # destination blocks on the decode worker
    num_layers: int  # K and V of each layer follow, in layer order


class Embeddings(msgspec.Struct, tag="emb"):
    mm_hash: str  # the item these vision embeddings belong to


class Done(msgspec.Struct, tag="done"):
    pass


Header = KVTransfer | Embeddings | Done


def digest(t: Any) -> list:
    """dtype, shape and sha256 of a tensor's bytes."""
    import torch

    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _recv_main(args: argparse.Namespace) -> None:
    import torch
    import zmq
    from triptych.connector import BadMessage, make_connector
    from triptych.connector.auth import load_keys

    torch.set_num_threads(1)
    keys = load_keys(args.keys, args.key_name) if args.keys else None
    if keys is not None and args.allow is not None:  # admit only these names' keys
        keys = dataclasses.replace(keys, peers={n: keys.peers[n] for n in args.allow.split(",")})
    conns = {k: make_connector(k, name=f"peer-{k}", header_type=Header, keys=keys,
                               shm_prefix=args.prefix) for k in args.kinds.split(",")}
    _emit({"addresses": {k: c.address for k, c in conns.items()}, "pid": os.getpid()})
    parent, deadline = os.getppid(), time.monotonic() + args.deadline
    poller = zmq.Poller()
    for c in conns.values():
        poller.register(c.poll_socket(), zmq.POLLIN)
    done = False
    while not done and time.monotonic() < deadline and os.getppid() == parent:
        if args.no_read:
            time.sleep(0.05)
            continue
        ready = dict(poller.poll(100))
        for kind, c in conns.items():
            if c.poll_socket() not in ready:
                continue
            try:
                msg = c.recv(0)
            except BadMessage as e:
                _emit({"kind": kind, "error": str(e)})
                continue
            if msg is None:
                continue
            done = done or isinstance(msg.header, Done)
            _emit({"kind": kind, "prefix": args.prefix, "header": msgspec.to_builtins(msg.header),
                   "tensors": [digest(t) for t in msg.tensors], "peer_key": msg.peer_key})
    for c in conns.values():
        c.close()


def _send_main(args: argparse.Namespace) -> None:
    import torch
    from triptych.connector import make_connector

    torch.set_num_threads(1)
    conn = make_connector(args.kind, name="peer-send", header_type=Header,
                          shm_prefix=args.prefix)
    t = torch.arange(4096, dtype=torch.float32)
    n = conn.send(args.to, Embeddings("from-a-dying-sender"), [t])
    _emit({"sent": n, "pid": os.getpid(), "tensors": [digest(t)]})
    parent, deadline = os.getppid(), time.monotonic() + args.deadline
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.05)  # wait to be killed, like a worker that dies mid-job
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--kinds", default="shm,tcp")
    r.add_argument("--keys")
    r.add_argument("--key-name")
    r.add_argument("--allow", help="comma-separated key names this receiver admits")
    r.add_argument("--no-read", action="store_true", help="bind but never read")
    s = sub.add_parser("send")
    s.add_argument("--kind", default="shm")
    s.add_argument("--to", required=True)
    for p in (r, s):
        p.add_argument("--prefix", default="triptych-")
        p.add_argument("--deadline", type=float, default=60.0)
    args = ap.parse_args()
    (_recv_main if args.mode == "recv" else _send_main)(args)


# -- the parent's side ----------------------------------------------------------------
class Peer:
    """A running peer process and its JSON lines (every wait bounded)."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout: float = 30.0) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"peer {self.proc.pid} said nothing in {timeout} s") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def load() -> Any:
    """This file as a module (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("connector_peer", __file__)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["connector_peer"] = mod
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    main()
