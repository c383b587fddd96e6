"""Connector speed between two processes on this box: latency and bytes/s per transport.

    PYTHONPATH=... python bench/connector.py                 # shm, tcp, tcp+curve
    python bench/connector.py --kinds shm --blocks 1,8 --reps 5

A message is a KV transfer shaped like a 7B model's (28 layers, 8 KV heads, head_dim 128,
bf16, block_size 16): K and V per layer, ``[num_blocks, 16, 8, 128]`` each, i.e.
1.75 MiB per block. The receiver runs in its own process (started with subprocess) and
acks every message with its one-way time (sender's send() start -> tensors ready there;
one host, one clock). latency: one message at a time, median. bytes/s: ``--burst``
messages back to back, first send start to last ack. inproc is measured in one process,
for reference (no bytes move).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 28, 8, 128, 16


class Transfer(msgspec.Struct, tag="kv"):
    seq: int  # message number
    ack_to: str  # where the receiver sends its Ack


class Ack(msgspec.Struct, tag="ack"):
    seq: int  # the message acknowledged
    seconds: float  # its one-way time as the receiver saw it
    nbytes: int  # tensor bytes it carried
    cpu_s: float  # the receiver's process CPU time so far (all its threads)


Msg = Transfer | Ack


def kv(num_blocks: int) -> list:
    import torch

    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(2 * LAYERS)]


def _make(kind: str, name: str, keys_dir: str | None, key_name: str):
    from triptych.connector import Limits, make_connector
    from triptych.connector.auth import load_keys

    keys = load_keys(keys_dir, key_name) if keys_dir else None
    return make_connector(kind, name=name, header_type=Msg, keys=keys,
                          limits=Limits(max_message_bytes=2 << 30), send_timeout_ms=60000)


def serve(kind: str, keys_dir: str | None) -> None:
    """The receiving process: ack every Transfer until stdin closes."""
    import select

    import torch

    torch.set_num_threads(1)
    conn = _make(kind, "bench-rx", keys_dir, "rx")
    print(json.dumps({"address": conn.address}), flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # EOF on stdin: the parent is done
        msg = conn.recv(100)
        if msg is not None and isinstance(msg.header, Transfer):
            conn.send(msg.header.ack_to,
                      Ack(msg.header.seq, msg.seconds, msg.nbytes, time.process_time()))
    conn.close()


def measure(conn, peer: str, blocks: int, reps: int, burst: int) -> dict:
    tensors = kv(blocks)
    seq = 0

    def wait_ack() -> Ack:
        while True:
            msg = conn.recv(60000)
            if msg is None:
                raise TimeoutError("no ack in 60 s")
            if isinstance(msg.header, Ack):
                return msg.header

    one_way, send_s, one_way_cpu = [], [], []
    for _ in range(reps + 1):  # the first warms the connection
        seq += 1
        t0 = time.perf_counter()
        conn.send(peer, Transfer(seq, conn.address), tensors)
        send_s.append(time.perf_counter() - t0)
        ack = wait_ack()
        one_way.append(ack.seconds)
        one_way_cpu.append(ack.cpu_s)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(burst):
        seq += 1
        conn.send(peer, Transfer(seq, conn.address), tensors)
    acks = [wait_ack() for _ in range(burst)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    nbytes = sum(a.nbytes for a in acks)
    rx_cpu = acks[-1].cpu_s - one_way_cpu[-1]  # the receiver's CPU over the burst
    return {"mib": nbytes / burst / 2**20, "latency_ms": 1000 * statistics.median(one_way[1:]),
            "send_ms": 1000 * statistics.median(send_s[1:]), "gib_s": nbytes / wall / 2**30,
            # CPU seconds both processes spent per GiB moved (the box's real cost)
            "cpu_s_gib": (cpu + rx_cpu) / (nbytes / 2**30)}


def run_kind(kind: str, blocks: list[int], reps: int, burst: int) -> list[dict]:
    keys_dir = None
    base = kind.removesuffix("+curve")
    if kind.endswith("+curve"):
        from triptych.connector.auth import generate_keys
        keys_dir = tempfile.mkdtemp(prefix="bench-keys-")
        generate_keys(keys_dir, ["rx", "tx"])
    if base == "inproc":
        rx = _make("inproc", "bench-rx", None, "rx")
        tx = _make("inproc", "bench-tx", None, "tx")
        out = []
        for b in blocks:
            tensors = kv(b)
            t0 = time.perf_counter()
            for i in range(reps):
                tx.send(rx.address, Transfer(i, ""), tensors)
                rx.recv(1000)
            dt = (time.perf_counter() - t0) / reps
            out.append({"kind": kind, "blocks": b, "mib": sum(t.nbytes for t in tensors) / 2**20,
                        "latency_ms": 1000 * dt, "send_ms": float("nan"), "gib_s": float("nan"),
                        "cpu_s_gib": float("nan")})
        tx.close()
        rx.close()
        return out
    child = subprocess.Popen([sys.executable, __file__, "--serve", base]
                             + (["--keys", keys_dir] if keys_dir else []),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tx = None
    try:
        assert child.stdout is not None
        peer = json.loads(child.stdout.readline())["address"]
        tx = _make(base, "bench-tx", keys_dir, "tx")
        return [{"kind": kind, "blocks": b, **measure(tx, peer, b, reps, burst)} for b in blocks]
    finally:
        if tx is not None:
            tx.close()
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)
        if keys_dir:
            shutil.rmtree(keys_dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kinds", default="inproc,shm,tcp,tcp+curve")
    ap.add_argument("--blocks", default="1,8,32", help="KV blocks per message (1.75 MiB each)")
    ap.add_argument("--reps", type=int, default=5, help="latency samples per size")
    ap.add_argument("--burst", type=int, default=4, help="messages per throughput sample")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--keys", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.keys)
        return 0
    import torch

    torch.set_num_threads(1)
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"{'transport':<11} {'blocks':>6} {'MiB':>7} {'latency ms':>11} {'send ms':>8} "
          f"{'GiB/s':>6} {'CPU s/GiB':>9}")
    for kind in args.kinds.split(","):
        for r in run_kind(kind, blocks, args.reps, args.burst):
            print(f"{r['kind']:<11} {r['blocks']:>6} {r['mib']:>7.1f} {r['latency_ms']:>11.2f} "
                  f"{r['send_ms']:>8.2f} {r['gib_s']:>6.2f} {r['cpu_s_gib']:>9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
