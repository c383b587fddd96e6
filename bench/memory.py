"""Each worker's memory per layout: ``python -m triptych.bench.memory``.

For each layout (bench/layouts.py names: colocated, 1e1p1d, 1e1pd, ...) it starts
`triptych serve` on loopback, waits for /health, and prints one row per worker: its pool,
the weight parts it loaded and their bytes (what /health reports, measured by the worker
at load), and its resident set size (VmRSS of its pid, read from /proc: local workers
only). The serve process itself (API + router, the workers' parent) gets a row too. One
request with an image goes through first, so every worker has run its part once. With
``--tensor-parallel-size N`` each worker is a group: one row per rank (``name/rK``), its
bytes as that rank process measured them (RSS: rank 0's only).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile


def _rss(pid: int | None) -> int | None:
    """VmRSS of ``pid`` in bytes (None when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _one_request(base: str) -> None:
    import base64
    import io

    import httpx
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (224, 224, 3), np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    r = httpx.post(base + "/v1/chat/completions", timeout=600, json={
        "model": "bench", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "Describe."}]}]})
    r.raise_for_status()


def measure(model: str, layout: str, log_path: str, tp: int = 1) -> list[dict]:
    import httpx

    from triptych.bench.layouts import layout_flags, serving

    flags = layout_flags(layout) + ["--served-model-name", "bench"]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
    with serving(model, flags, log_path) as base:
        _one_request(base)
        pools = httpx.get(base + "/health", timeout=10).json()["pools"]
        rows, parent = [], None
        for pool, p in pools.items():
            for w in p["workers"]:
                weights = w.get("weights", {})
                ranks = weights.get("ranks") or [weights.get("bytes", {})]
                for r, b in enumerate(ranks):
                    rows.append({"layout": layout, "pool": pool, "parts": weights.get("parts"),
                                 "worker": w["name"] + (f"/r{r}" if len(ranks) > 1 else ""),
                                 "vision_bytes": b.get("vision"),
                                 "language_bytes": b.get("language"),
                                 "rss_bytes": _rss(w["pid"]) if r == 0 else None})
                parent = parent or (w["pid"] and _parent(w["pid"]))
        rows.append({"layout": layout, "worker": "serve (API + router)", "pool": "-",
                     "parts": "-", "vision_bytes": 0, "language_bytes": 0,
                     "rss_bytes": _rss(parent)})
        return rows


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    from triptych.models.contract import contract_names

    p = argparse.ArgumentParser(prog="python -m triptych.bench.memory",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint dir (default: the bench's ~106M random checkpoint of --arch)")
    p.add_argument("--arch", choices=contract_names(), default="qwen2_vl",
                   help="architecture of the random checkpoint (ignored with --model)")
    p.add_argument("--layouts", default="colocated,1e1p1d",
                   help="comma-separated layouts (bench/layouts.py names)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of every worker (one row per rank)")
    p.add_argument("--json-out", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    from triptych.models.demo import BENCH_FLAGS, tiny_checkpoint

    model = args.model or tiny_checkpoint(args.arch, **BENCH_FLAGS)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
            rows += measure(model, layout, os.path.join(tmp, f"{layout}.log"),
                            args.tensor_parallel_size)
    print(f"{'layout':<10} {'worker':<22} {'parts':<9} {'vision MiB':>11} "
          f"{'language MiB':>13} {'RSS MiB':>9}")
    for r in rows:
        print(f"{r['layout']:<10} {r['worker']:<22} {r['parts'] or '-':<9} "
              f"{_mib(r['vision_bytes']):>11} {_mib(r['language_bytes']):>13} "
              f"{_mib(r['rss_bytes']):>9}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": model, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
