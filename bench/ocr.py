"""`triptych bench ocr`: pages/s and output tokens/s of `triptych ocr` over a generated PDF.

The PDF holds ``--pages`` pages of a few printed lines each (demo/render.py, Pillow's PDF
writer at 72 dpi, rasterized back at ``--dpi 72`` so each page reaches the model at the size
the demo model was trained on). Each configuration runs the real `triptych ocr` command
once with ``--max-concurrency`` >= the page count, so every page is in flight from the
start; the work's span is the slowest page's request time (the per-page ``seconds`` of the
JSONL output): pages/s = pages / span, output tokens/s = tokens / span. Interpreter, import
and engine start stay out of it (on a loaded box they vary more than the work itself).
Configurations: in-process or ``--server`` (a `triptych serve` started here), each
colocated and E+P+D (1e1p1d). Default model: the built-in demo checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

CONFIGS = {"in-process": (False, []), "in-process-1e1p1d": (False, ["1e1p1d"]),
           "server": (True, []), "server-1e1p1d": (True, ["1e1p1d"])}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ocr", help="pages/s of `triptych ocr` over a generated PDF",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (unset: the built-in demo model)")
    p.add_argument("--pages", type=int, default=8, help="pages in the generated PDF")
    p.add_argument("--lines-per-page", type=int, default=3, help="printed lines per page")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--max-tokens", type=int, default=256, help="most output tokens per page")
    p.add_argument("--seed", type=int, default=7, help="seed of the page texts")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")


def write_pdf(d: str, pages: int, lines: int, seed: int) -> str:
    """A PDF of ``pages`` pages of rendered printed lines."""
    from triptych.demo.render import render_page, sample_text

    rng = random.Random(seed)
    images = [render_page([sample_text(rng, 30) for _ in range(lines)], rng, clean=True)
              for _ in range(pages)]
    path = os.path.join(d, "doc.pdf")
    images[0].save(path, "PDF", save_all=True, append_images=images[1:], resolution=72.0)
    return path


def _ocr(pdf: str, out: str, extra: list[str]) -> dict[str, Any]:
    """One `triptych ocr` run: its wall time, the span of its pages and their tokens."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "triptych", "ocr", pdf, "-o", out, "--format",
                        "jsonl", "--dpi", "72", "--no-progress", *extra],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"triptych ocr failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(out, os.path.basename(pdf) + ".jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    span = max(x["seconds"] for x in rows)
    tokens = sum(x["completion_tokens"] for x in rows)
    return {"wall_s": round(wall, 1), "span_s": round(span, 2), "output_tokens": tokens,
            "pages_per_s": round(len(rows) / span, 3),
            "output_tokens_per_s": round(tokens / span, 1)}


def run(args: argparse.Namespace) -> int:
    from triptych.bench.layouts import layout_flags, serving
    from triptych.models.demo import demo_checkpoint

    model = args.model or demo_checkpoint()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(names) - set(CONFIGS) or args.pages < 1:
        raise SystemExit(f"--configs from {', '.join(CONFIGS)}; --pages at least 1")
    report: dict[str, Any] = {"model": model, "pages": args.pages,
                              "lines_per_page": args.lines_per_page,
                              "max_tokens": args.max_tokens, "configs": {}}
    with tempfile.TemporaryDirectory() as d:
        full = write_pdf(d, args.pages, args.lines_per_page, args.seed)
        common = ["--max-concurrency", str(args.pages), "--max-tokens", str(args.max_tokens)]
        for i, name in enumerate(names):
            remote, layout = CONFIGS[name]
            flags = layout_flags(layout[0]) if layout else []
            out = os.path.join(d, f"out{i}")
            if remote:
                with serving(model, flags, os.path.join(d, f"{name}.log")) as base:
                    rep = _ocr(full, out, ["--server", base, *common])
            else:
                rep = _ocr(full, out, ["--model", model, *flags, *common])
            report["configs"][name] = rep
            print(f"{name:18} {rep['pages_per_s']:6.3f} pages/s {rep['output_tokens_per_s']:7.1f} "
                  f"output tok/s ({args.pages} pages in {rep['span_s']:.1f} s, "
                  f"{rep['output_tokens']} tokens; command wall {rep['wall_s']:.0f} s)",
                  flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_out}")
    return 0
