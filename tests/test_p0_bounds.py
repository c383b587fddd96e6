"""P0 cannot be exhausted before admission (issue 15, point 3): request bodies held at once
are bounded (429 + Retry-After beyond), and a domain whose DNS never answers cannot hold
up other users' media fetches. (Admission past --max-pending-requests, also a 429, is
tested in test_server.py.)"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import file_server, img, module_server, png, text_part, user
from triptych.api.media.limits import MediaError, MediaLimits
from triptych.api.media.resolver import Resolver
from triptych.api.media.sources import afetch_bytes

BODY_CAP = 25_000_000
INFLIGHT = 50_000_000  # two bodies of BODY_SIZE at once, not three
BODY_SIZE = 20_000_000


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--max-model-len", "512", "--served-model-name", "tiny",
                             "--max-request-bytes", str(BODY_CAP),
                             "--max-inflight-body-bytes", str(INFLIGHT))


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_many_large_bodies_at_once_leave_p0_memory_bounded(server):
    pid = server.proc.pid  # P0: the HTTP server (workers are its children)
    # A large body that is cheap past parsing: 20 MB of text, refused (400) by the prompt
    # length check. What it costs P0 is reading and parsing it: what the bound is about.
    body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x" * BODY_SIZE}]}).encode()
    assert len(body) < BODY_CAP
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
    before = status_kb(pid, "VmRSS") * 1024
    results: list[httpx.Response] = []
    barrier = threading.Barrier(30)

    def send() -> None:
        barrier.wait()
        results.append(httpx.post(server.base + "/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json"}, timeout=120))

    threads = [threading.Thread(target=send) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    peak = status_kb(pid, "VmHWM") * 1024
    # Each body held costs P0 its bytes a few times over (the received chunks, the joined
    # body, the parsed string): 4x the in-flight bound, plus slack for the rest of P0.
    # Without the bound, 30 bodies at once are 30 x 20 MB read at least twice (> 1 GB).
    bound = 4 * INFLIGHT + (64 << 20)
    assert peak - before < bound, f"P0's peak RSS grew by {(peak - before) >> 20} MiB"
    codes = sorted(r.status_code for r in results)
    assert set(codes) <= {400, 429} and 429 in codes and 400 in codes, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert "--max-inflight-body-bytes" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": user(text_part("hi")), "max_tokens": 2})
    assert r.status_code == 200


# -- DNS -------------------------------------------------------------------------------------
class HangingDNS:
    """A getaddrinfo hook: names under ``blackhole.test`` never answer (until released);
    every other name is 127.0.0.1, where the test's file server listens."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.hanging = 0
        self.entered = threading.Condition()

    def __call__(self, host: str, port: int) -> list:
        if host.endswith("blackhole.test"):
            with self.entered:
                self.hanging += 1
                self.entered.notify_all()
            self.release.wait()
            raise OSError("no answer")
        import socket
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", port))]


def test_a_never_answering_domain_does_not_hold_up_other_fetches(tmp_path):
    (tmp_path / "a.png").write_bytes(png(img(1)))
    httpd = file_server(tmp_path)
    dns = HangingDNS()
    resolver = Resolver(threads=4, per_domain=2, lookup=dns)
    limits = MediaLimits(resolver=resolver, allow_private_addresses=True,
                         fetch_timeout_s=60.0)
    port = httpd.server_address[1]

    async def main() -> None:
        # Many fetches of one black-holed domain (random subdomains, and one name many
        # times): more than the resolver has threads.
        bad = [asyncio.ensure_future(afetch_bytes(
            f"http://x{i % 12}.blackhole.test/a.png", limits, 1 << 20)) for i in range(24)]
        await asyncio.to_thread(lambda: _wait_hanging(dns, 2))
        good = await afetch_bytes(f"http://media.example:{port}/a.png", limits, 1 << 20)
        assert good == (tmp_path / "a.png").read_bytes()
        assert not dns.release.is_set() and dns.hanging == 2, "the bad lookups still hang"
        pending = [t for t in bad if not t.done()]
        refused = [t for t in bad if t.done()]
        # two names got the domain's two threads (their waiters still wait); every other
        # fetch of the domain was refused at once, without taking a thread
        assert len(pending) == 4 and len(refused) == 20
        assert all("too many lookups" in str(t.exception()) for t in refused)
        # A waiter leaves at its deadline though the lookup it waits on never ends.
        short = MediaLimits(resolver=resolver, allow_private_addresses=True,
                            fetch_timeout_s=0.2)
        with pytest.raises(MediaError, match="longer than|timed out"):
            await afetch_bytes("http://x0.blackhole.test/a.png", short, 1 << 20)
        assert not dns.release.is_set()
        # Waiters on the domain's lookups are bounded too (4 per lookup thread: 8), so one
        # bad name cannot take every one of the fetcher's slots.
        more = [asyncio.ensure_future(afetch_bytes("http://x0.blackhole.test/a.png", limits,
                                                   1 << 20)) for _ in range(10)]
        for _ in range(3000):  # (a hang guard of tens of seconds; the refusals come at once)
            if sum(t.done() for t in more) >= 6:
                break
            await asyncio.sleep(0.01)
        assert sum(t.done() for t in more) == 6
        assert all("too many lookups" in str(t.exception()) for t in more if t.done())
        pending += [t for t in more if not t.done()]
        bad += more
        for t in pending:
            t.cancel()
        await asyncio.gather(*bad, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        dns.release.set()  # the resolver's threads finish their lookups and idle
        httpd.shutdown()


def _wait_hanging(dns: HangingDNS, n: int) -> None:
    with dns.entered:
        assert dns.entered.wait_for(lambda: dns.hanging >= n, timeout=30)
