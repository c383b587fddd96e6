"""Another user, in a process of its own: one chat request after another, each one's
seconds printed as JSON at the end. The benches that ask "what does this cost the others"
(`bench attacks`, `bench prep`) time their victim here, so that its latencies never include
the bench's own client work (encoding 26 MB of JSON, sending 16 images at once) under the
same GIL.

    python -m triptych.bench.chat_probe BASE_URL BODY_JSON [--count N] [--key KEY]

``--count 0``: until stdin is closed. A refusal counts as ``null``.
"""
from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
import time


def start(base: str, body: dict, count: int = 0, key: str | None = None) -> subprocess.Popen:
    """The probe as a child process (``count`` 0: until ``result`` closes its stdin)."""
    cmd = [sys.executable, "-m", "triptych.bench.chat_probe", base, json.dumps(body),
           "--count", str(count)]
    if key:
        cmd += ["--key", key]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 1800) -> list[float | None]:
    """Stop the probe (if it runs until told) and return its latencies."""
    assert proc.stdin is not None and proc.stdout is not None
    if not proc.stdin.closed:
        proc.stdin.close()
    out = proc.stdout.read()
    if proc.wait(timeout):
        raise RuntimeError("the chat probe failed")
    return json.loads(out)


def main(argv: list[str] | None = None) -> None:
    import httpx

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("body", help="the chat request's JSON body")
    p.add_argument("--count", type=int, default=0, help="requests (0: until stdin closes)")
    p.add_argument("--key", default=None, help="API key")
    args = p.parse_args(argv)
    body = json.loads(args.body)
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    out: list[float | None] = []
    with httpx.Client(timeout=600, headers=headers) as c:
        while (len(out) < args.count) if args.count else \
                not select.select([sys.stdin], [], [], 0)[0]:
            t0 = time.perf_counter()
            r = c.post(args.base + "/v1/chat/completions", json=body)
            out.append(time.perf_counter() - t0 if r.status_code == 200 else None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
