"""`triptych bench attacks`: issue 42's attacks replayed; what each costs another tenant.

The attacks run against a real server, one after another.

A server (the built-in demo model unless ``--model``) with two tenants: alice attacks, bob
sends a short text chat (16 tokens) one after another. For each attack, bob's median and
worst latency under attack against his latency on the idle server, and what the attack got
(its status codes, or what became of it):

    sockets    1,030 connections that send nothing / their headers a line at a time
    grammar    an ambiguous EBNF grammar whose matcher costs more per token as it goes
    whitelist  vllm_xargs.whitelist_token_ids with 3 M entries
    jpegs      40 progressive JPEGs whose decoding runs for seconds
    answer     n=16, max_tokens=1500, logprobs with top_logprobs=20, not streamed
    answer-plain  the same without logprobs: what the 16 sequences cost by themselves
    messages   250,000 empty user messages
    queue      alice's requests fill --max-pending-requests

127.0.0.1 only; each attack is bounded in count and time and stops by itself.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

ALICE, BOB = "key-alice-attacks-000", "key-bob-attacks-00000"
AMBIGUOUS = 'root ::= s\ns ::= s s s | s s | "a" | ""'


def slow_jpeg(repeats: int = 1500) -> bytes:
    """A 2000 x 2000 progressive JPEG with its last refinement scan repeated: each repeat
    is one more pass over every block (~7 ms here) for ~14 bytes of file."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (2000, 2000), 128).save(buf, format="JPEG", progressive=True, quality=90)
    data, i, segs = buf.getvalue(), 2, []
    while data[i + 1] != 0xD9:
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        j = i + 2 + length
        if marker == 0xDA:  # entropy-coded data runs to the next marker
            while not (data[j] == 0xFF and data[j + 1] and not 0xD0 <= data[j + 1] <= 0xD7):
                j += 1
        segs.append((i, j))
        i = j
    last_scan = data[segs[-2][0]:segs[-1][1]]  # its Huffman table and its scan
    return data[:i] + last_scan * repeats + b"\xff\xd9"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("attacks", help="issue 42's attacks replayed: what each costs another "
                                       "tenant", description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (unset: the demo model)")
    p.add_argument("--attacks",
                   default="sockets,grammar,whitelist,jpegs,answer,answer-plain,messages,queue",
                   help="which, comma-separated")
    p.add_argument("--victims", type=int, default=8, help="bob's requests per measurement")
    p.add_argument("--json-out", default=None, help="also write the figures here")
    p.add_argument("--serve-args", default="",
                   help="more flags for the server, as one string (e.g. "
                        "\"--tenant-step-share 0.25\"): the attacks replayed against your "
                        "settings")


def _post(base: str, key: str, body: dict, timeout: float = 300) -> Any:
    import httpx

    return httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


BOB_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "min_tokens": 16, "temperature": 0}


def _bob(base: str, n: int) -> list[float]:
    """Bob's ``n`` 16-token chats one after another, from his own process
    (bench/chat_probe.py): each one's seconds (inf for a refusal)."""
    from triptych.bench import chat_probe

    lat = chat_probe.result(chat_probe.start(base, BOB_CHAT, n, BOB))
    return [float("inf") if x is None else x for x in lat]


def _during(attackers: list[Callable[[], Any]], base: str, victims: int,
            head_start: float = 1.0) -> tuple[list[float], list[Any]]:
    """Bob's latencies while ``attackers`` (each run once, on its own thread) are at work,
    and what each attacker got."""
    results: list[Any] = [None] * len(attackers)

    def run(i: int) -> None:
        results[i] = attackers[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(len(attackers))]
    for t in threads:
        t.start()
    time.sleep(head_start)
    lat = _bob(base, victims)
    for t in threads:
        t.join(1800)
    return lat, results


def attack_sockets(base: str, port: int, victims: int) -> tuple[list[float], str]:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(1030)]
    for s in socks[-30:]:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nX-Slow: 1\r\n")
    try:
        import httpx
        health = httpx.get(base + "/health", timeout=30).status_code
        return _bob(base, victims), f"/health {health} with 1,030 sockets open"
    finally:
        for s in socks:
            s.close()


def attack_grammar(base: str, victims: int, a_id: int) -> tuple[list[float], str]:
    # the bias makes "a" (a_id) the greedy pick among what the grammar allows
    body = {"messages": [{"role": "user", "content": "count"}],
            "max_tokens": 400, "temperature": 0, "logit_bias": {str(a_id): 100},
            "structured_outputs": {"grammar": AMBIGUOUS}}
    lat, (r,) = _during([lambda: _post(base, ALICE, body)], base, victims)
    if r.status_code != 200:
        return lat, f"attacker: {r.status_code} {r.text[:160]}"
    got = r.json()
    return lat, (f"attacker: 200, finish_reason {got['choices'][0]['finish_reason']!r} after "
                 f"{got['usage']['completion_tokens']} tokens")


def attack_whitelist(base: str, victims: int) -> tuple[list[float], str]:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16,
            "vllm_xargs": {"ngram_size": 2, "whitelist_token_ids": list(range(3_000_000))}}
    raw = json.dumps(body).encode()  # encoded once, as an attacker would
    stop, codes = threading.Event(), []

    def loop() -> None:
        import httpx

        while not stop.is_set():
            try:
                codes.append(httpx.post(
                    base + "/v1/chat/completions", content=raw, timeout=300,
                    headers={"Authorization": f"Bearer {ALICE}",
                             "Content-Type": "application/json"}).status_code)
            except httpx.HTTPError as e:  # the server may close before the body is sent
                codes.append(type(e).__name__)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    time.sleep(0.5)
    lat = _bob(base, victims)
    stop.set()
    t.join(120)
    return lat, f"attacker: {sorted(set(map(str, codes)))} x{len(codes)}"


def attack_jpegs(base: str, victims: int) -> tuple[list[float], str]:
    url = "data:image/jpeg;base64," + base64.b64encode(slow_jpeg()).decode()
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}]}
    lat, rs = _during([lambda: _post(base, ALICE, body, timeout=900)] * 40, base, victims)
    return lat, f"attacker: {sorted({r.status_code for r in rs})}"


def attack_answer(base: str, victims: int, logprobs: bool = True) -> tuple[list[float], str]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "story"}], "n": 16,
                            "max_tokens": 1500, "min_tokens": 1500, "temperature": 1.0}
    if logprobs:
        body |= {"logprobs": True, "top_logprobs": 20}
    def timed() -> tuple[Any, float]:
        t0 = time.perf_counter()
        return _post(base, ALICE, body, timeout=1800), time.perf_counter() - t0

    lat, ((r, took),) = _during([timed], base, victims)
    return lat, f"attacker: {r.status_code}, {len(r.content) / 1e6:.1f} MB body in {took:.1f} s"


def attack_messages(base: str, victims: int) -> tuple[list[float], str]:
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": ""}] * 250_000}
    lat, (r,) = _during([lambda: _post(base, ALICE, body)], base, victims, head_start=0.0)
    return lat, f"attacker: {r.status_code} {r.json()['error']['message'][:90]}"


def attack_queue(base: str, victims: int, limit: int) -> tuple[list[float], str]:
    body = {"messages": [{"role": "user", "content": "go"}], "n": 16,
            "max_tokens": 400, "min_tokens": 400, "temperature": 1.0}
    lat, rs = _during([lambda: _post(base, ALICE, body, timeout=900)] * (limit // 16 + 2),
                      base, victims)
    return lat, f"attacker: {sorted(r.status_code for r in rs)}"


def run(args: argparse.Namespace) -> int:
    import httpx
    from transformers import AutoTokenizer
    from triptych.bench.layouts import _free_port
    from triptych.bench.prep import machine
    from triptych.models.demo import demo_checkpoint

    names = [a.strip() for a in args.attacks.split(",") if a.strip()]
    tok = AutoTokenizer.from_pretrained(args.model or demo_checkpoint())
    (a_id,) = tok.encode("a", add_special_tokens=False)
    report: dict[str, Any] = {"machine": machine(), "serve_args": args.serve_args,
                              "attacks": {}}
    print(report["machine"], flush=True)
    with tempfile.TemporaryDirectory() as d:
        keys = os.path.join(d, "keys")
        with open(keys, "w") as f:
            f.write(f"{ALICE} alice\n{BOB} bob\n")
        os.chmod(keys, 0o600)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "triptych", "serve", "--host", "127.0.0.1", "--port",
               str(port), "--api-keys-file", keys, "--max-request-bytes", str(64 << 20),
               *(["--model", args.model] if args.model else []), *shlex.split(args.serve_args)]
        with open(os.path.join(d, "serve.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.time() + 600
                while True:
                    try:
                        if httpx.get(base + "/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if proc.poll() is not None or time.time() > deadline:
                        raise SystemExit("the server did not start")
                    time.sleep(0.5)
                _bob(base, 2)  # warm; and wait for the grammar compile processes, which a
                # server with keys starts with itself (their start is not an attack)
                _post(base, BOB, {"messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 2, "structured_outputs": {"regex": "[ab]+"}},
                      timeout=300)
                for name in names:
                    idle = _bob(base, args.victims)
                    fn = {"sockets": lambda: attack_sockets(base, port, args.victims),
                          "grammar": lambda: attack_grammar(base, args.victims, a_id),
                          "whitelist": lambda: attack_whitelist(base, args.victims),
                          "jpegs": lambda: attack_jpegs(base, args.victims),
                          "answer": lambda: attack_answer(base, args.victims),
                          "answer-plain": lambda: attack_answer(base, args.victims, False),
                          "messages": lambda: attack_messages(base, args.victims),
                          "queue": lambda: attack_queue(base, args.victims, 256)}[name]
                    loaded, what = fn()
                    row = {"idle_s": statistics.median(idle),
                           "attacked_s": statistics.median(loaded),
                           "attacked_max_s": max(loaded), "attack": what}
                    row["ratio"] = row["attacked_s"] / row["idle_s"]
                    report["attacks"][name] = row
                    print(f"{name:12} bob {row['idle_s'] * 1000:6.0f} ms idle, "
                          f"{row['attacked_s'] * 1000:6.0f} ms under attack (x{row['ratio']:.2f}"
                          f", worst {row['attacked_max_s'] * 1000:.0f} ms); {what}", flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


__all__ = ["add_parser", "run", "slow_jpeg"]
