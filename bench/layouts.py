"""`triptych bench serve --layouts colocated,1e1pd,1e1p1d`: one load, every layout, one run.

For each layout it starts `triptych serve` (loopback, a free port), waits for /health, drives
the same image-heavy load at every --request-rate (bench/load.py), reads what moved
between pools from /metrics, and stops the server. It prints TTFT and ITL p50/p99, output
tok/s and goodput per layout and rate, the transfer cost per request, and draws one PNG.

Layout names: ``colocated`` (one engine), ``colocatedxN`` (N replicas), ``XeYpZd`` (pool
sizes), ``XeZpd`` / ``Zpd`` (decode workers that prefill too; with or without an encode
pool).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

_LAYOUT = re.compile(r"^(?:(\d+)e)?(?:(\d+)p)?(\d+)(pd|d)$")


def layout_flags(name: str) -> list[str]:
    """`triptych serve` flags of a layout name."""
    if name == "colocated":
        return []
    m = re.fullmatch(r"colocatedx(\d+)", name)
    if m:
        return ["--data-parallel-size", m.group(1)]
    m = _LAYOUT.fullmatch(name)
    if not m or (m.group(4) == "pd" and m.group(2)):
        raise ValueError(f"unknown layout {name!r}: use colocated, colocatedxN, XeYpZd or XeZpd")
    e, p, d, kind = m.groups()
    flags = ["--decode-workers", d]
    if e:
        flags += ["--encode-workers", e]
    if kind == "d":
        flags += ["--prefill-workers", p or "1"]
    return flags


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model: str, flags: list[str], log_path: str) -> Iterator[str]:
    """A `triptych serve` on 127.0.0.1 for the duration; yields its base URL."""
    import httpx

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "triptych", "serve", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 900
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/health", timeout=2).json().get("status") == "ok":
                        break
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the server did not start; see {log_path}")
                time.sleep(0.5)
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _metrics(base: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}  # every sample of a name summed (over pools)
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def warmup(args: argparse.Namespace, base: str) -> None:
    """A few requests first, not recorded: the first steps of a fresh server allocate."""
    import copy

    from triptych.bench.load import sweep
    w = copy.copy(args)
    w.num_requests, w.request_rate, w.seed = 4, "inf", args.seed + 99_999
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        sweep(w, base)


def _transfer(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    """Bytes and seconds moved between pools, per completed request."""
    def d(name: str) -> float:
        return after.get(f"triptych:{name}", 0.0) - before.get(f"triptych:{name}", 0.0)

    n = max(requests, 1)
    return {"kv_bytes_per_request": d("kv_transfer_bytes_total") / n,
            "kv_seconds_per_request": d("kv_transfer_seconds_sum") / n,
            "embedding_bytes_per_request": d("embedding_transfer_bytes_total") / n,
            "embedding_seconds_per_request": d("embedding_transfer_seconds_sum") / n}


def run_layouts(args: argparse.Namespace) -> int:
    from triptych.bench.load import output_path, sweep
    from triptych.models.demo import DEMO_FLAGS, tiny_checkpoint

    model = args.serve_model or tiny_checkpoint("qwen2_vl", **DEMO_FLAGS)
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    for n in layouts:
        layout_flags(n)  # fail before starting anything
    backends = [b.strip() for b in
                getattr(args, "distributed_executor_backend", "mp").split(",") if b.strip()]
    if not backends or set(backends) - {"mp", "ray"}:
        raise SystemExit("--distributed-executor-backend: mp, ray or mp,ray")
    # each layout under each backend: "1e1p1d" (mp alone) or "1e1p1d@ray"
    names = {(n if backends == ["mp"] else f"{n}@{b}"): (n, b)
             for n in layouts for b in backends}
    report: dict[str, dict] = {}
    logs = output_path(args, "bench_layouts_logs")
    os.makedirs(logs, exist_ok=True)
    for name, (layout, backend) in names.items():
        print(f"== layout {name}", flush=True)
        flags = layout_flags(layout) + shlex.split(args.serve_args)
        if backend != "mp":
            flags += ["--distributed-executor-backend", backend]
        with serving(model, flags, os.path.join(logs, f"{name}.log")) as base:
            warmup(args, base)
            before = _metrics(base)
            results = sweep(args, base)
            time.sleep(0.6)  # the workers' last stats reach the router
            after = _metrics(base)
        done = sum(r["completed"] for r in results)
        report[name] = {"flags": flags, "results": results,
                        "transfer": _transfer(before, after, done)}
    _table(report)
    json_out, plot = output_path(args, args.json_out), output_path(args, args.plot)
    with open(json_out, "w") as f:
        json.dump({"model": model, "num_requests": args.num_requests,
                   "images_per_request": args.images_per_request,
                   "image_size": args.image_size, "max_tokens": args.max_tokens,
                   "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                   "layouts": report}, f, indent=2)
    _plot(report, plot)
    print(f"wrote {json_out} and {plot} (server logs in {logs})")
    return 0


def _table(report: dict[str, dict]) -> None:
    head = (f"{'layout':14} {'rate':>5} {'req/s':>6} {'tok/s':>7} {'goodput':>7} "
            f"{'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15} {'KV B/req':>9} {'KV ms/req':>9} "
            f"{'emb B/req':>9}")
    print(head)
    for name, rep in report.items():
        t = rep["transfer"]
        for r in rep["results"]:
            print(f"{name:14} {r['request_rate']:>5g} {r['request_throughput']:6.2f} "
                  f"{r['output_tokens_per_s']:7.1f} {r['goodput']:7.2f} "
                  f"{r.get('ttft_p50_ms', math.nan):8.0f}/{r.get('ttft_p99_ms', math.nan):<8.0f} "
                  f"{r.get('itl_p50_ms', math.nan):7.1f}/{r.get('itl_p99_ms', math.nan):<7.1f} "
                  f"{t['kv_bytes_per_request']:9.0f} {1e3 * t['kv_seconds_per_request']:9.2f} "
                  f"{t['embedding_bytes_per_request']:9.0f}")


def _plot(report: dict[str, dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rep in report.items():
        rs = sorted(rep["results"], key=lambda r: r["request_rate"])
        finite = [r["request_rate"] for r in rs if math.isfinite(r["request_rate"])]
        top = max(finite, default=1.0)
        x = [r["request_rate"] if math.isfinite(r["request_rate"]) else top * 1.5 for r in rs]
        for ax, key in zip(axes, ("goodput", "ttft_p99_ms", "itl_p99_ms")):
            ax.plot(x, [r.get(key, math.nan) for r in rs], "o-", label=name)
    for ax, title in zip(axes, ("goodput (req/s meeting the SLOs)", "TTFT p99 (ms)",
                                "ITL p99 (ms)")):
        ax.set_xlabel("request rate (req/s; rightmost = all at once)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
