"""`triptych bench prep`: image preparation through the HTTP server, where it is the
bottleneck (issue 41).

A tiny Qwen2-VL whose processor resizes to at most 448 x 448 (the model costs little)
serves image chats of 1080p / 4K photos, ``--concurrency`` at a time, one output token each,
with every cache off (each image is prepared every time). Servers with each preparation
setting run side by side; rounds alternate between them and figures are medians:

    filed        ``--baseline DIR``: the engine of another checkout (e.g. the commit the
                 issue was filed at), with its own defaults: the path as it was
    hf-in-P0     --mm-processor-workers 0 --mm-preprocessor hf   (HF's processor in P0)
    fast-in-P0   --mm-processor-workers 0                        (the fast path in P0)
    workers-N    --mm-processor-workers N                        (preparation processes)
    workers-N+E  the same, the vision tower in an encode worker of its own
                 (``--encode-pool``: --encode-workers 1 --decode-workers 1)

For each: image chats per second and CPU milliseconds per image in P0, in the preparation
processes and in the engine worker (from /proc), with the images alone; then, with the same
images again, the latency of a text-only request sent one after another while they stream
in, against the same request on the idle server (median and p99), from a client process of
its own. First, the preprocessing steps alone per image size (bench/prep.py).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

CACHES_OFF = ["--mm-processor-cache-gb", "0", "--encoder-cache-size", "0",
              "--no-enable-prefix-caching"]
_TICK = os.sysconf("SC_CLK_TCK")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prep", help="image preparation through the server: chats/s, CPU per "
                                    "image, text latency while images stream",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="checkpoint (unset: a tiny Qwen2-VL made here, images resized to at "
                        "most 448 x 448)")
    p.add_argument("--sizes", default="1920x1080,3840x2160", help="photo sizes, WxH,...")
    p.add_argument("--images", type=int, default=48, help="image chats per round and size")
    p.add_argument("--concurrency", type=int, default=16, help="image chats in flight")
    p.add_argument("--rounds", type=int, default=3, help="rounds (alternating configs)")
    p.add_argument("--workers", default="0,1,2",
                   help="--mm-processor-workers values to compare (0 also as hf-in-P0)")
    p.add_argument("--skip-steps", action="store_true",
                   help="skip the preprocessing-steps table (bench/prep.py)")
    p.add_argument("--encode-pool", action="store_true",
                   help="also serve the most preparation processes with the vision tower in "
                        "an encode worker of its own (--encode-workers 1 --decode-workers 1): "
                        "text steps then never hold an image's tower")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="also serve with the triptych checkout in DIR (its own defaults, as "
                        "'filed'), e.g. `git worktree add DIR <commit>` of the commit an issue "
                        "was filed at: the path as it was, side by side in the same run")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw them: chats/s, CPU per image by process, text latency "
                        "under the images (bench/prep_plot.py)")


def configs(workers: list[int]) -> dict[str, list[str]]:
    out = {"hf-in-P0": ["--mm-processor-workers", "0", "--mm-preprocessor", "hf"]}
    for n in workers:
        out["fast-in-P0" if n == 0 else f"workers-{n}"] = ["--mm-processor-workers", str(n)]
    return out


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


class Server:
    """One `triptych serve` for the bench, its pids read from /health (an open server)."""

    def __init__(self, model: str, flags: list[str], log: str,
                 checkout: str | None = None) -> None:
        import httpx
        from triptych.bench.layouts import _free_port

        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")  # noqa: SIM115
        env = None
        if checkout:  # `triptych` imported from the other checkout: a folder holding a link
            link = os.path.join(os.path.dirname(log), "baseline", "triptych")
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if not os.path.islink(link):
                os.symlink(os.path.abspath(checkout), link)
            env = {**os.environ, "PYTHONPATH": os.path.dirname(link)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "triptych", "serve", "--model", model, "--host",
             "127.0.0.1", "--port", str(self.port), "--max-model-len", "2048", *CACHES_OFF,
             *flags], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server did not start; see {log}")
            time.sleep(0.5)

    def warm(self, url: str) -> None:
        """One image chat first: the preparation processes start at the first image."""
        import httpx

        httpx.post(self.base + "/v1/chat/completions", timeout=600, json=_chat(
            [{"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "What is it?"}])).raise_for_status()

    def pids(self) -> dict[str, list[int]]:
        import httpx

        h = httpx.get(self.base + "/health", timeout=10).json()
        workers = [w["pid"] for p in h.get("pools", {}).values() for w in p["workers"]]
        return {"p0": [self.proc.pid], "prep": h.get("preparation", {}).get("pids", []),
                "worker": workers}

    def cpu(self) -> dict[str, float]:
        return {k: sum(_cpu_s(p) for p in v) for k, v in self.pids().items()}

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _chat(content: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}],
            "max_tokens": 1, "temperature": 0}


async def _round(server: Server, url: str, images: int, concurrency: int) -> dict[str, Any]:
    import httpx
    from triptych.bench import chat_probe

    text = _chat("Say one word.")  # from a client process of its own (bench/chat_probe.py)
    idle = chat_probe.result(chat_probe.start(server.base, text, 8))  # on the idle server
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        body = _chat([{"type": "image_url", "image_url": {"url": url}},
                      {"type": "text", "text": "What is it?"}])
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                (await client.post(server.base + "/v1/chat/completions", json=body)
                 ).raise_for_status()

        # phase 1, images alone: throughput and CPU per image
        cpu0, t0 = server.cpu(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(images)))
        wall, cpu1 = time.perf_counter() - t0, server.cpu()
        # phase 2, the same images with a text chat sent one after another beside them
        probe = chat_probe.start(server.base, text)
        await asyncio.gather(*(one() for _ in range(images)))
        loaded = chat_probe.result(probe)  # (closing its stdin stops it)
    ms = {k: 1000 * (cpu1[k] - cpu0[k]) / images for k in cpu0}
    return {"chats_per_s": images / wall, "p0_ms": ms["p0"], "prep_ms": ms["prep"],
            "worker_ms": ms["worker"], "text_idle_s": statistics.median(idle),
            "text_loaded_s": statistics.median(loaded),
            "text_loaded_p99_s": sorted(loaded)[max(0, int(0.99 * len(loaded)) - 1)]}


def _median(rounds: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


@contextlib.contextmanager
def _servers(model: str, cfgs: dict[str, list[str]], d: str, baseline: str | None
             ) -> Iterator[dict[str, Server]]:
    servers: dict[str, Server] = {}
    try:
        for name, flags in cfgs.items():
            servers[name] = Server(model, flags, os.path.join(d, f"{name}.log"),
                                   baseline if name == "filed" else None)
        yield servers
    finally:
        for s in servers.values():
            s.close()


def run(args: argparse.Namespace) -> int:
    from triptych.bench.prep import format_rows, machine, measure, photo

    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    report: dict[str, Any] = {"machine": machine(), "sizes": args.sizes, "server": {}}
    print(report["machine"], flush=True)
    if not args.skip_steps:
        import torch

        torch.set_num_threads(1)  # as P0 and the preparation processes run
        rows = measure(tuple(sizes), rounds=5)  # type: ignore[arg-type]
        print("CPU ms per image, the preparation steps alone (bench/prep.py)")
        print(format_rows(rows), flush=True)
        report["steps"] = [{"size": list(r.size), "setup": r.setup, "ms": r.ms} for r in rows]
    cfgs = configs([int(x) for x in args.workers.split(",")])
    if args.encode_pool:
        n = max(int(x) for x in args.workers.split(","))
        cfgs[f"workers-{n}+E"] = ["--mm-processor-workers", str(n), "--encode-workers", "1",
                                  "--decode-workers", "1"]
    if args.baseline:
        cfgs = {"filed": [], **cfgs}
    with tempfile.TemporaryDirectory() as d:
        model = args.model
        if model is None:
            from triptych.models.tiny import make_tiny
            model = make_tiny("qwen2_vl", os.path.join(d, "tiny"), seed=0)
        with _servers(model, cfgs, d, args.baseline) as servers:
            warm = "data:image/jpeg;base64," + base64.b64encode(photo(640, 480)).decode()
            for server in servers.values():
                server.warm(warm)
            for w, h in sizes:
                url = "data:image/jpeg;base64," + base64.b64encode(photo(w, h)).decode()
                per: dict[str, list[dict[str, Any]]] = {n: [] for n in cfgs}
                for r in range(args.rounds):
                    order = list(cfgs) if r % 2 == 0 else list(reversed(cfgs))
                    for name in order:
                        per[name].append(asyncio.run(_round(servers[name], url, args.images,
                                                            args.concurrency)))
                table = {n: _median(v) for n, v in per.items()}
                report["server"][f"{w}x{h}"] = table
                _print(f"{w}x{h}", table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_out}")
    if args.plot:
        from triptych.bench.prep_plot import plot
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _print(size: str, table: dict[str, dict[str, float]]) -> None:
    base = table["hf-in-P0"]["chats_per_s"]
    filed = table.get("filed", {}).get("chats_per_s")
    print(f"\n{size} photos, medians over rounds")
    print(f"{'config':12} {'chats/s':>8} {'x hf-in-P0':>10} {'x filed':>7} {'P0 ms/img':>9} {'prep ms/img':>11} "
          f"{'worker ms':>9} {'text idle':>9} {'text load':>9} {'x idle':>6} {'p99':>7}")
    for name, t in table.items():
        vs_filed = f"{t['chats_per_s'] / filed:7.2f}" if filed else f"{'-':>7}"
        print(f"{name:12} {t['chats_per_s']:8.2f} {t['chats_per_s'] / base:10.2f} {vs_filed} "
              f"{t['p0_ms']:9.1f} {t['prep_ms']:11.1f} {t['worker_ms']:9.1f} "
              f"{t['text_idle_s'] * 1000:7.0f}ms {t['text_loaded_s'] * 1000:7.0f}ms "
              f"{t['text_loaded_s'] / t['text_idle_s']:6.1f} {t['text_loaded_p99_s'] * 1000:5.0f}ms",
              flush=True)


__all__ = ["add_parser", "configs", "run"]
