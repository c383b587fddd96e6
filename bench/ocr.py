"""`triptych bench ocr`: pages/s and output tokens/s of `triptych ocr` over a generated PDF.

The PDF holds ``--pages`` pages of a few printed lines each (demo/render.py, Pillow's PDF
writer at 72 dpi, rasterized back at ``--dpi 72`` so each page reaches the model at the size
the demo model was trained on). Each configuration runs the real `triptych ocr` command
twice, over a one-page PDF and over the full one; the difference is the steady state
(interpreter, import and engine start cancel out): pages/s = (N - 1) / (t_N - t_1).
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
    p.add_argument("--max-concurrency", type=int, default=8, help="`triptych ocr` concurrency")
    p.add_argument("--seed", type=int, default=7, help="seed of the page texts")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")


def write_pdfs(d: str, pages: int, lines: int, seed: int) -> tuple[str, str]:
    """(one-page PDF, full PDF) of rendered printed lines."""
    from triptych.demo.render import render_page, sample_text

    rng = random.Random(seed)
    images = [render_page([sample_text(rng, 30) for _ in range(lines)], rng, clean=True)
              for _ in range(pages)]
    one, full = os.path.join(d, "one.pdf"), os.path.join(d, "doc.pdf")
    images[0].save(one, "PDF", resolution=72.0)
    images[0].save(full, "PDF", save_all=True, append_images=images[1:], resolution=72.0)
    return one, full


def _ocr(pdf: str, out: str, extra: list[str]) -> tuple[float, int]:
    """Wall seconds of one `triptych ocr` run, and the output tokens it reports."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "triptych", "ocr", pdf, "-o", out, "--format",
                        "jsonl", "--dpi", "72", "--no-progress", *extra],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"triptych ocr failed:\n{r.stderr[-3000:]}")
    name = os.path.splitext(os.path.basename(pdf))[0] + ".jsonl"
    with open(os.path.join(out, name)) as f:
        tokens = sum(json.loads(x)["completion_tokens"] for x in f if x.strip())
    return wall, tokens


def run(args: argparse.Namespace) -> int:
    from triptych.bench.layouts import layout_flags, serving
    from triptych.models.demo import demo_checkpoint

    model = args.model or demo_checkpoint()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(names) - set(CONFIGS) or args.pages < 2:
        raise SystemExit(f"--configs from {', '.join(CONFIGS)}; --pages at least 2")
    report: dict[str, Any] = {"model": model, "pages": args.pages,
                              "lines_per_page": args.lines_per_page, "configs": {}}
    with tempfile.TemporaryDirectory() as d:
        one, full = write_pdfs(d, args.pages, args.lines_per_page, args.seed)
        for i, name in enumerate(names):
            remote, layout = CONFIGS[name]
            flags = layout_flags(layout[0]) if layout else []
            common = ["--max-concurrency", str(args.max_concurrency)]
            outs = [os.path.join(d, f"out{i}-{k}") for k in range(2)]
            if remote:
                with serving(model, flags, os.path.join(d, f"{name}.log")) as base:
                    t1, _ = _ocr(one, outs[0], ["--server", base, *common])
                    tn, tokens = _ocr(full, outs[1], ["--server", base, *common])
            else:
                t1, _ = _ocr(one, outs[0], ["--model", model, *flags, *common])
                tn, tokens = _ocr(full, outs[1], ["--model", model, *flags, *common])
            steady = max(tn - t1, 1e-9)
            rep = {"wall_one_page_s": round(t1, 2), "wall_all_pages_s": round(tn, 2),
                   "output_tokens": tokens,
                   "pages_per_s": round((args.pages - 1) / steady, 3),
                   "output_tokens_per_s": round(tokens * (args.pages - 1) / args.pages / steady, 1)}
            report["configs"][name] = rep
            print(f"{name:18} {rep['pages_per_s']:6.2f} pages/s {rep['output_tokens_per_s']:7.1f} "
                  f"output tok/s (1 page {t1:.1f} s, {args.pages} pages {tn:.1f} s, "
                  f"{tokens} tokens)", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_out}")
    return 0
