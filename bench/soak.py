"""`triptych bench soak`: does every process's memory stay flat under a long load?

It starts `triptych serve` in one layout (default 1e1p1d, loopback, a free port), drives
--num-requests image chat requests at --concurrency through the real HTTP server (the
images drawn from --distinct-images seeded pictures, so the processor, encoder and
prefix caches fill to their bounds and then churn), and samples every process's RSS
(VmRSS, and its anonymous / shared-memory parts, from /proc) every --sample-s seconds:
P0 and each worker (pids from /health; P0 is the workers' parent). At the end it stops
the server and checks that nothing of it is left in /dev/shm.

The verdict per process: mean RSS over the first fifth of the samples after the warm-up
(--warmup-frac of the requests) vs over the last fifth, and the slope after warm-up (MB
per 1,000 requests, a least-squares line):
a cache filling to its bound levels off, a leak keeps its slope. JSON + PNG (RSS per
process vs requests completed) go to --output-dir.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import threading
import time
from typing import Any

import numpy as np
from triptych.bench.load import add_output_args, image_url, output_path

SHM_DIR = "/dev/shm"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("soak", help="RSS of every process over a long image-chat load "
                                           "(flat or leaking?), with a plot",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layout", default="1e1p1d",
                   help="pool layout: colocated, colocatedxN, XeYpZd, XeZpd (bench serve's names)")
    p.add_argument("--serve-model", default=None,
                   help="checkpoint to serve (default: the tiny demo one)")
    p.add_argument("--serve-args", default="--mm-processor-cache-gb 0.05",
                   help="extra `triptych serve` flags")
    p.add_argument("--num-requests", type=int, default=10_000, help="requests in all")
    p.add_argument("--distinct-images", type=int, default=300,
                   help="pictures the requests draw from (seeded); repeats hit the caches")
    p.add_argument("--image-size", type=int, default=224, help="image width = height, pixels")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup-frac", type=float, default=0.2,
                   help="share of the requests counted as warm-up (caches filling)")
    p.add_argument("--seed", type=int, default=0, help="seed of the images and their order")
    add_output_args(p, "bench_soak.json", plot="bench_soak.png")


# -- memory of a process -------------------------------------------------------------------
def rss_mb(pid: int) -> dict[str, float] | None:
    """VmRSS and its RssAnon / RssShmem parts in MB (None: the process is gone)."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:
        return None
    return out


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def workers_of(base: str) -> dict[str, int]:
    """name -> pid of every local worker, from /health."""
    import httpx
    h = httpx.get(base + "/health", timeout=10).json()
    return {w["name"]: w["pid"] for pool in h["pools"].values() for w in pool["workers"]
            if w.get("pid") and not w.get("remote")}


class Sampler(threading.Thread):
    """RSS of each named process every ``every_s`` seconds, beside the requests done."""

    def __init__(self, pids: dict[str, int], done: list[int], every_s: float) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pids, self.done, self.every_s = pids, done, every_s
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        procs = {name: rss_mb(pid) for name, pid in self.pids.items()}
        self.samples.append({"t": time.monotonic(), "requests": self.done[0],
                             "rss": {n: m for n, m in procs.items() if m is not None}})

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()


# -- the load ------------------------------------------------------------------------------
async def drive(base: str, model: str, args: argparse.Namespace, done: list[int]) -> dict:
    """--num-requests chat requests, --concurrency at a time; counts ok / failed."""
    import httpx

    rng = np.random.default_rng(args.seed)
    images = [image_url(rng, args.image_size) for _ in range(args.distinct_images)]
    order = rng.integers(0, len(images), args.num_requests)
    url = base + "/v1/chat/completions"
    errors: dict[str, int] = {}
    next_i = [0]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": images[order[i]]}},
                    {"type": "text", "text": f"Describe picture {order[i]} ({i})."}]}]}
        try:
            r = await client.post(url, json=body, timeout=600)
            if r.status_code != 200:
                errors[f"HTTP {r.status_code}"] = errors.get(f"HTTP {r.status_code}", 0) + 1
        except httpx.HTTPError as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
        done[0] += 1

    async def lane(client: httpx.AsyncClient) -> None:
        while next_i[0] < args.num_requests:
            i = next_i[0]
            next_i[0] += 1
            await one(client, i)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency)) as c:
        await asyncio.gather(*(lane(c) for _ in range(args.concurrency)))
    return {"duration_s": time.perf_counter() - t0, "failed": sum(errors.values()),
            "errors": errors}


# -- the verdict ---------------------------------------------------------------------------
def verdict(samples: list[dict], warm_requests: int) -> dict[str, dict[str, float]]:
    """Per process: RSS after warm-up and at the end, growth %, slope in MB / 1k requests."""
    out: dict[str, dict[str, float]] = {}
    names = {n for s in samples for n in s["rss"]}
    for name in sorted(names):
        pts = [(s["requests"], s["rss"][name]["VmRSS"]) for s in samples if name in s["rss"]]
        warm = [p for p in pts if p[0] >= warm_requests] or pts[-1:]
        if not warm:
            continue
        x, y = np.array([p[0] for p in warm], float), np.array([p[1] for p in warm])
        slope = float(np.polyfit(x, y, 1)[0]) * 1000 if len(set(x)) > 1 else 0.0
        # NOTE: growth compares the means of the first and last fifth after warm-up: a
        # process whose RSS saws up and down (P0's request buffers) is judged by its level.
        k = max(1, len(y) // 5)
        out[name] = {"first_mb": pts[0][1], "after_warmup_mb": float(y[:k].mean()),
                     "end_mb": float(y[-k:].mean()), "max_mb": float(y.max()),
                     "min_after_warmup_mb": float(y.min()),
                     "growth_pct": 100 * float(y[-k:].mean() - y[:k].mean()) / float(y[:k].mean()),
                     "slope_mb_per_1k_requests": slope}
    return out


def leftover_segments(p0_pid: int) -> list[str]:
    """/dev/shm entries of this server (named after its pid) still there."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"triptych-{p0_pid}-"))
    except OSError:
        return []


def run(args: argparse.Namespace) -> int:
    import httpx
    from triptych.bench.layouts import layout_flags, serving
    from triptych.models.demo import DEMO_FLAGS, tiny_checkpoint

    model = args.serve_model or tiny_checkpoint("qwen2_vl", **DEMO_FLAGS)
    flags = layout_flags(args.layout) + shlex.split(args.serve_args)
    log = output_path(args, "bench_soak_server.log")
    done = [0]
    with serving(model, flags, log) as base:
        workers = workers_of(base)
        p0 = parent_pid(next(iter(workers.values())))
        name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        sampler = Sampler({"P0": p0, **workers}, done, args.sample_s)
        sampler.sample()
        sampler.start()
        try:
            load = asyncio.run(drive(base, name, args, done))
        finally:
            sampler.stop.set()
            sampler.join()
        sampler.sample()
        restarts = {w: p for w, p in workers_of(base).items() if p != workers.get(w)}
    left = leftover_segments(p0)
    warm = int(args.num_requests * args.warmup_frac)
    report = {"model": model, "layout": args.layout, "flags": flags,
              "num_requests": args.num_requests, "distinct_images": args.distinct_images,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "image_size": args.image_size, "warmup_requests": warm, **load,
              "restarted_workers": sorted(restarts), "shm_left": left,
              "rss": verdict(sampler.samples, warm), "samples": sampler.samples}
    _print(report)
    json_out, plot = output_path(args, args.json_out), output_path(args, args.plot)
    with open(json_out, "w") as f:
        json.dump(report, f, indent=1)
    _plot(report, plot)
    print(f"wrote {json_out} and {plot} (server log {log})")
    return 0 if not left and not load["failed"] and not restarts else 1


def _print(rep: dict) -> None:
    print(f"{rep['layout']}: {rep['num_requests']} requests in {rep['duration_s']:.0f} s, "
          f"{rep['failed']} failed {rep['errors'] or ''}; restarted: "
          f"{rep['restarted_workers'] or 'none'}; /dev/shm left: {rep['shm_left'] or 'nothing'}")
    print(f"{'process':12} {'start MB':>9} {'warm MB':>8} {'end MB':>8} {'max MB':>8} "
          f"{'growth':>7} {'MB/1k req':>9}")
    for name, v in rep["rss"].items():
        print(f"{name:12} {v['first_mb']:9.0f} {v['after_warmup_mb']:8.0f} {v['end_mb']:8.0f} "
              f"{v['max_mb']:8.0f} {v['growth_pct']:6.1f}% {v['slope_mb_per_1k_requests']:9.2f}")


def _plot(rep: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in rep["rss"]:
        pts = [(s["requests"], s["rss"][name]["VmRSS"]) for s in rep["samples"]
               if name in s["rss"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax.axvline(rep["warmup_requests"], color="grey", ls=":", label="end of warm-up")
    ax.set_xlabel("requests completed")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"bench soak: {rep['layout']}, {rep['num_requests']} image chat requests, "
                 f"concurrency {rep['concurrency']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
