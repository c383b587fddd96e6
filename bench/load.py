"""The serving load every `triptych bench` command drives: seeded image-chat bodies,
one run per request rate (TTFT / TPOT / ITL on token arrival), the sweep over rates, and
where result files go. `bench serve`, `--layouts` and `multiturn` stand on this; it stands
on nothing of theirs."""
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


def image_url(rng: np.random.Generator, size: int) -> str:
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
            "url": image_url(rng, sizes[int(rng.integers(len(sizes)))])}} for _ in range(n)]
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


def print_rate(r: dict) -> None:
    print(f"rate {r['request_rate']}: {r['completed']} ok, {r['failed']} failed in "
          f"{r['duration_s']:.1f} s | {r['request_throughput']:.2f} req/s, "
          f"{r['output_tokens_per_s']:.1f} output tok/s, goodput {r['goodput']:.2f} req/s")
    for name in ("ttft", "tpot", "itl"):
        if f"{name}_mean_ms" in r:
            print(f"  {name.upper():5} mean {r[f'{name}_mean_ms']:8.1f} ms  p50 "
                  f"{r[f'{name}_p50_ms']:8.1f} ms  p99 {r[f'{name}_p99_ms']:8.1f} ms")


def sweep(args: argparse.Namespace, base_url: str) -> list[dict]:
    """Every rate of --request-rate against the server at ``base_url``."""
    import httpx

    args.base_url = base_url
    model = args.model or httpx.get(base_url.rstrip("/") + "/v1/models").json()["data"][0]["id"]
    results = []
    for i, rate in enumerate(float(r) for r in str(args.request_rate).split(",")):
        r = asyncio.run(_run_rate(args, model, rate, args.seed + 1000 * (i + 1)))
        print_rate(r)
        results.append(r)
    return results
