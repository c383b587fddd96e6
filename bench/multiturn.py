"""`triptych bench multiturn`: multi-turn image conversations, caches off, each alone, all on.

Each conversation has two images in its first message and --turns turns; every turn sends
the whole conversation so far (as a chat client does), so the images come again each turn.
For each cache configuration the bench starts `triptych serve` (loopback, a free port),
runs the conversations (--concurrency at a time, turns in order within one) and reports
TTFT p50/p99 of turn 1 and of turns >= 2, turns/s, and the cached prompt tokens; then the
P0 cost of a processor-cache hit against a miss, measured on the InputProcessor itself.

    off        --mm-processor-cache-gb 0 --encoder-cache-size 0 --no-enable-prefix-caching
    processor  only the processor cache            encoder   only the encoder cache
    prefix     only the prefix cache               all       the defaults: all three
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import numpy as np

CONFIGS = {
    "off": ["--mm-processor-cache-gb", "0", "--encoder-cache-size", "0",
            "--no-enable-prefix-caching"],
    "processor": ["--encoder-cache-size", "0", "--no-enable-prefix-caching"],
    "encoder": ["--mm-processor-cache-gb", "0", "--no-enable-prefix-caching"],
    "prefix": ["--mm-processor-cache-gb", "0", "--encoder-cache-size", "0"],
    "all": [],
}


def add_parser(sub: Any) -> None:
    from triptych.bench.load import add_output_args

    p = sub.add_parser("multiturn", help="multi-turn image chats: each cache's effect on TTFT",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint to serve (default: the ~106M random checkpoint of `bench "
                        "throughput`; 'demo' for the tiny demo one)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="cache configurations to run")
    p.add_argument("--conversations", type=int, default=32, help="conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--image-size", type=int, default=448, help="image width = height")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn")
    p.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    p.add_argument("--serve-args", default="", help="extra `triptych serve` flags")
    p.add_argument("--seed", type=int, default=0, help="seed of the images")
    add_output_args(p, "bench_multiturn.json")


def _images(rng: np.random.Generator, size: int) -> list[str]:
    from triptych.bench.load import image_url
    return [image_url(rng, size) for _ in range(2)]


async def _turn(client: Any, url: str, model: str, messages: list[dict], max_tokens: int
                ) -> tuple[float, str, int]:
    """One streamed turn: (TTFT seconds, answer text, cached prompt tokens)."""
    t0 = time.perf_counter()
    ttft, text, cached = None, "", 0
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            # (a token arrives with its ids: a random checkpoint's often decode to no text)
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += chunk["choices"][0]["delta"].get("content", "")
    return ttft if ttft is not None else time.perf_counter() - t0, text, cached


async def _conversations(base: str, args: argparse.Namespace, images: list[list[str]]) -> dict:
    import httpx

    url = base + "/v1/chat/completions"
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    first, later, cached = [], [], []
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int, client: Any) -> None:
        async with gate:
            msgs: list[dict] = [{"role": "user", "content": [
                *[{"type": "image_url", "image_url": {"url": u}} for u in images[i]],
                {"type": "text", "text": f"Conversation {i}: compare the two pictures."}]}]
            for t in range(args.turns):
                ttft, answer, c = await _turn(client, url, model, msgs, args.max_tokens)
                (first if t == 0 else later).append(ttft)
                cached.append(c)
                msgs += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Turn {t + 2}: and what else?"}]

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(one(i, client) for i in range(len(images))))
    dur = time.perf_counter() - t0

    def ms(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q) * 1e3) if xs else float("nan")

    return {"turn1_ttft_p50_ms": ms(first, 50), "turn1_ttft_p99_ms": ms(first, 99),
            "later_ttft_p50_ms": ms(later, 50), "later_ttft_p99_ms": ms(later, 99),
            "turns_per_s": (len(first) + len(later)) / dur,
            "cached_tokens_per_turn": float(np.mean(cached)), "duration_s": dur}


def _processor_cost(model: str, size: int, rounds: int = 5) -> dict:
    """P0's cost of one 2-image prompt: a processor-cache miss (decode + HF processor) vs a
    hit (hash only), measured on the InputProcessor itself."""
    from triptych.api.processor import InputProcessor
    from triptych.mmcache import ProcessorCacheIndex

    rng = np.random.default_rng(1)
    proc = InputProcessor(model, cache=ProcessorCacheIndex(1 << 30), max_model_len=32768)
    miss, hit = [], []
    for _ in range(rounds):
        urls = _images(rng, size)
        msgs = [{"role": "user", "content": [
            *[{"type": "image_url", "image_url": {"url": u}} for u in urls],
            {"type": "text", "text": "Compare."}]}]
        for bucket in (miss, hit):
            t0 = time.perf_counter()
            proc.process_chat(msgs)
            bucket.append(time.perf_counter() - t0)
    return {"miss_ms": float(np.median(miss) * 1e3), "hit_ms": float(np.median(hit) * 1e3)}


def run(args: argparse.Namespace) -> int:
    import shlex

    from triptych.bench.layouts import serving
    from triptych.bench.load import output_path
    from triptych.models.demo import BENCH_FLAGS, DEMO_FLAGS, tiny_checkpoint

    model = args.model or tiny_checkpoint("qwen2_vl", **BENCH_FLAGS)
    if model == "demo":
        model = tiny_checkpoint("qwen2_vl", **DEMO_FLAGS)
    rng = np.random.default_rng(args.seed)
    images = [_images(rng, args.image_size) for _ in range(args.conversations)]
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; use {', '.join(CONFIGS)}")
    logs = output_path(args, "bench_multiturn_logs")
    os.makedirs(logs, exist_ok=True)
    report: dict[str, Any] = {}
    for name in names:
        flags = CONFIGS[name] + ["--max-model-len", "8192"] + shlex.split(args.serve_args)
        with serving(model, flags, os.path.join(logs, f"{name}.log")) as base:
            report[name] = asyncio.run(_conversations(base, args, images))
        r = report[name]
        print(f"{name:9} turn 1 TTFT p50 {r['turn1_ttft_p50_ms']:7.0f} ms p99 "
              f"{r['turn1_ttft_p99_ms']:7.0f} | turns >= 2 p50 {r['later_ttft_p50_ms']:7.0f} "
              f"ms p99 {r['later_ttft_p99_ms']:7.0f} | {r['turns_per_s']:.2f} turns/s | "
              f"{r['cached_tokens_per_turn']:.0f} cached tokens/turn", flush=True)
    if "off" in report and "all" in report:
        ratio = report["off"]["later_ttft_p50_ms"] / report["all"]["later_ttft_p50_ms"]
        print(f"turns >= 2 TTFT p50: all caches on is {ratio:.1f}x lower than all off")
        report["later_ttft_ratio_off_over_all"] = ratio
    report["processor_cost"] = _processor_cost(model, args.image_size)
    pc = report["processor_cost"]
    print(f"P0 processing of a 2-image prompt: miss {pc['miss_ms']:.1f} ms, hit "
          f"{pc['hit_ms']:.1f} ms ({pc['miss_ms'] / max(pc['hit_ms'], 1e-9):.0f}x)")
    json_out = output_path(args, args.json_out)
    with open(json_out, "w") as f:
        json.dump({"model": model, "conversations": args.conversations, "turns": args.turns,
                   "image_size": args.image_size, "max_tokens": args.max_tokens,
                   "concurrency": args.concurrency, "results": report}, f, indent=2)
    print(f"wrote {json_out} (server logs in {logs})")
    return 0
