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
import json
import math
from typing import Any

from triptych.bench.load import add_output_args, output_path, sweep


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
    p.add_argument("--distributed-executor-backend", default="mp",
                   help="with --layouts: how the servers start their workers: mp, ray, or "
                        "mp,ray to run every layout under both (Ray: the cluster at "
                        "RAY_ADDRESS, else one started per server; docs/ray.md)")
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
