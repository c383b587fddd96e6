"""`triptych bench serve`: load a server with image chat requests at a rate.

Requests carry random images (a fixed seed; --images-per-request and --image-size take a
range / a list for a mixed load) and ask for a fixed number of tokens; arrivals are Poisson
at --request-rate (inf = all at once). Streaming responses give TTFT (first generated token),
ITL (gaps between chunks) and TPOT ((latency - TTFT) / (tokens - 1)); goodput counts the
requests per second that meet both SLOs (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms,
DistServe's measure). A sweep over rates writes a JSON file and a PNG into --output-dir
(./bench-results/ unless told; git ignores it) and prints where they went.

With --layouts the command starts `triptych serve` itself once per layout (bench/layouts.py)
and compares them on the same load.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_OUTPUT_DIR = "bench-results"  # relative to where the command runs; in .gitignore

def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="load a server (TTFT / TPOT / ITL / goodput, plots); "
                                            "--layouts compares pool layouts",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--layouts", default=None,
                   help="start `triptych serve` per layout and compare, e.g. "
                        "colocated,1e1pd,1e1p1d (XeYpZd = pool sizes; 'pd' = decode workers "
                        "prefill too; colocated = one engine)")
    p.add_argument("--serve-model", default=None,
                   help="with --layouts: checkpoint to serve (default: the tiny demo one)")
    p.add_argument("--serve-args", default="",
                   help="with --layouts: extra `triptych serve` flags for every layout")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate")
    p.add_argument("--request-rate", default="inf",
                   help="requests/s (Poisson arrivals); comma-separated for a sweep, e.g. 1,2,4,inf")
    p.add_argument("--image-size", default="224",
                   help="image width = height; a comma list picks one per image (mixed sizes)")
    p.add_argument("--images-per-request", default="1",
                   help="images in each request; LO-HI draws uniformly (e.g. 1-4)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT bound")
    p.add_argument("--seed", type=int, default=0, help="seed of images and arrivals")
    add_output_args(p, "bench_serve.json", plot="bench_serve.png")


def add_output_args(p: argparse.ArgumentParser, json_name: str, plot: str | None = None) -> None:
    """--output-dir and the result file names in it (`bench serve`, `--layouts`,
    `bench multiturn`): nothing is written into the current directory itself."""
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                   help="folder for results, plots and server logs (made if missing)")
    p.add_argument("--json-out", default=json_name, help="results file, in --output-dir")
    if plot:
        p.add_argument("--plot", default=plot, help="PNG of TTFT and ITL vs rate, in "
                                                    "--output-dir")


def output_path(args: argparse.Namespace, name: str) -> str:
    """``name`` inside --output-dir (an absolute ``name`` stays where it is)."""
    os.makedirs(args.output_dir, exist_ok=True)
    return os.path.join(args.output_dir, name)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def _image_url(rng: np.random.Generator, size: int) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _one(client: Any, url: str, body: dict) -> Result:
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False)
    try:
        async with client.stream("POST", url, json=body, timeout=600) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                # A token arrives with its ids (return_token_ids): a random checkpoint's
                # tokens often decode to no text, so content alone would miss them.
                if not chunk["choices"] or not chunk["choices"][0].get("token_ids"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # noqa: BLE001 (a benchmark reports failures, it does not stop on them)
        res.error = type(e).__name__
    return res


def _bodies(args: argparse.Namespace, model: str, rng: np.random.Generator) -> list[dict]:
    """The load: each request's images (count and sizes drawn once, from the seed)."""
    lo, _, hi = str(args.images_per_request).partition("-")
    sizes = [int(x) for x in str(args.image_size).split(",")]
    bodies = []
    for i in range(args.num_requests):
        n = int(rng.integers(int(lo), int(hi or lo) + 1))
        images = [{"type": "image_url", "image_url": {
            "url": _image_url(rng, sizes[int(rng.integers(len(sizes)))])}} for _ in range(n)]
        bodies.append({"model": model, "stream": True,
                       "stream_options": {"include_usage": True},
                       "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True,
                       "messages": [{"role": "user", "content": [
                           *images, {"type": "text", "text": f"Describe picture {i}."}]}]})
    return bodies


async def _run_rate(args: argparse.Namespace, model: str, rate: float, seed: int) -> dict:
    import httpx

    # NOTE: each rate gets its own images (seed): the same ones again would be served from
    # the processor, encoder and prefix caches and make every later rate look cheap.
    rng = np.random.default_rng(seed)
    bodies = _bodies(args, model, rng)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        t0 = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(_one(client, url, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
    ok = [r for r in results if r.ok]

    def ms(xs: list[float], q: float | None = None) -> float:
        return float((np.percentile(xs, q) if q else np.mean(xs)) * 1e3)

    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and (
        r.output_tokens <= 1 or (r.latency - r.ttft) / (r.output_tokens - 1) * 1e3
        <= args.slo_tpot_ms)]
    out = {"request_rate": rate, "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": dur, "request_throughput": len(ok) / dur,
           "output_tokens_per_s": sum(r.output_tokens for r in ok) / dur,
           "goodput": len(good) / dur}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        if xs:
            out.update({f"{name}_mean_ms": ms(xs), f"{name}_p50_ms": ms(xs, 50),
                        f"{name}_p99_ms": ms(xs, 99)})
    return out


def _print(r: dict) -> None:
    print(f"rate {r['request_rate']}: {r['completed']} ok, {r['failed']} failed in "
          f"{r['duration_s']:.1f} s | {r['request_throughput']:.2f} req/s, "
          f"{r['output_tokens_per_s']:.1f} output tok/s, goodput {r['goodput']:.2f} req/s")
    for name in ("ttft", "tpot", "itl"):
        if f"{name}_mean_ms" in r:
            print(f"  {name.upper():5} mean {r[f'{name}_mean_ms']:8.1f} ms  p50 "
                  f"{r[f'{name}_p50_ms']:8.1f} ms  p99 {r[f'{name}_p99_ms']:8.1f} ms")


def _plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # "inf" (everything at once) is drawn one step right of the largest finite rate.
    results = sorted(results, key=lambda r: r["request_rate"])
    finite = [r["request_rate"] for r in results if math.isfinite(r["request_rate"])]
    top = max(finite, default=1.0)
    x = [r["request_rate"] if math.isfinite(r["request_rate"]) else top * 1.5 for r in results]
    labels = [f"{r['request_rate']:g}" for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("ttft", "itl")):
        for q, style in (("mean", "o-"), ("p50", "s--"), ("p99", "^:")):
            ax.plot(x, [r.get(f"{name}_{q}_ms", float("nan")) for r in results], style, label=q)
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_title(name.upper())
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def sweep(args: argparse.Namespace, base_url: str) -> list[dict]:
    """Every rate of --request-rate against the server at ``base_url``."""
    import httpx

    args.base_url = base_url
    model = args.model or httpx.get(base_url.rstrip("/") + "/v1/models").json()["data"][0]["id"]
    results = []
    for i, rate in enumerate(float(r) for r in str(args.request_rate).split(",")):
        r = asyncio.run(_run_rate(args, model, rate, args.seed + 1000 * (i + 1)))
        _print(r)
        results.append(r)
    return results


def run(args: argparse.Namespace) -> int:
    if args.layouts:
        from triptych.bench.layouts import run_layouts
        return run_layouts(args)
    results = sweep(args, args.base_url)
    rates = [r["request_rate"] for r in results]
    model = args.model
    json_out = output_path(args, args.json_out)
    with open(json_out, "w") as f:
        json.dump({"model": model, "num_requests": args.num_requests,
                   "image_size": args.image_size, "max_tokens": args.max_tokens,
                   "results": results}, f, indent=2)
    if len(rates) > 1:
        plot = output_path(args, args.plot)
        _plot(results, plot)
        print(f"wrote {json_out} and {plot}")
    else:
        print(f"wrote {json_out} (one rate: no plot)")
    return 0
