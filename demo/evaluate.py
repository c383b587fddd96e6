"""The demo model's held-out evaluation (demo/train.py, tests/test_demo_model.py): greedy
HF ``generate`` over rendered lines and short pages from seeds training never uses, and
their character error rate."""
from __future__ import annotations

import random
from typing import Any

from triptych.demo import render
from triptych.demo.batches import PROMPTS, Batcher


def greedy(model: Any, batcher: Batcher, image: Any, max_new: int = 160) -> str:
    import torch

    enc = batcher.proc(images=[image], return_tensors="pt")
    dev = model.device
    ids = torch.tensor([batcher.prompt_ids(enc["image_grid_thw"][0], PROMPTS[0])], device=dev)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == batcher.proc_image_id).long(),
                         pixel_values=enc["pixel_values"].to(dev),
                         image_grid_thw=enc["image_grid_thw"].to(dev),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=batcher.eos,
                         pad_token_id=batcher.pad)
    return batcher.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def heldout_pages(n: int, seed: int = 4242) -> list[tuple[Any, str]]:
    """Short clean pages (2-3 lines of up to 24 characters, 336 px wide) from a seed training
    never uses: the page half of the evaluation."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lines = [render.sample_text(rng, 24) for _ in range(rng.randint(2, 3))]
        out.append((render.render_page(lines, rng, width=336, clean=True), "\n".join(lines)))
    return out


def evaluate_strips(model: Any, batcher: Batcher, n: int, seed: int) -> float:
    """CER over ``n`` lines of the held-out kind (demo/heldout.py: ``seed`` DEV_SEED for
    choices made while training, never the held-out SEED) read as `triptych ocr` reads
    them: the layout step's strips, each read greedily, a line's pieces joined."""
    import torch
    from triptych.demo import heldout
    from triptych.demo.layout import line_strips

    errs = tot = 0
    with torch.no_grad():
        for s in heldout.lines(n, seed):
            read = [" ".join(t for p in row if (t := greedy(model, batcher, p).strip()))
                    for row in line_strips(s.image)]
            e, t = render.cer("\n".join(read), s.text)
            errs, tot = errs + e, tot + t
    return errs / tot


def evaluate(model: Any, batcher: Batcher, n: int, pages: bool = False) -> float:
    """CER over ``n`` held-out lines (render.heldout_lines: a seed training never uses), or
    ``n`` held-out short pages (``heldout_pages``)."""
    import torch

    errs = tot = 0
    with torch.no_grad():
        for img, ref in (heldout_pages(n) if pages else render.heldout_lines(n)):
            e, t = render.cer(greedy(model, batcher, img), ref)
            errs, tot = errs + e, tot + t
    return errs / tot


def main(argv: list[str] | None = None) -> int:
    """``python -m triptych.demo.evaluate --heldout``: the held-out table of
    docs/demo-model.md (demo/heldout_eval.py)."""
    import argparse

    from triptych.demo import heldout_eval

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heldout", action="store_true", required=True,
                   help="read the held-out set (demo/heldout.py) through `triptych ocr` and "
                        "`triptych run-batch` and print its CER per condition")
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in demo)")
    p.add_argument("--lines", type=int, default=240, help="single lines")
    p.add_argument("--screenshots", type=int, default=40, help="screenshots of 2-4 lines")
    p.add_argument("--pdfs", type=int, default=8, help="PDFs of 2-3 pages")
    p.add_argument("--prompt-lines", type=int, default=40,
                   help="lines read under every prompt family")
    p.add_argument("--layout", choices=["lines", "page"], default="lines",
                   help="`triptych ocr --layout` for lines, screenshots and PDFs (page: the "
                        "images as they are, without the layout step)")
    p.add_argument("--json-out", default=None, help="also write the figures here (JSON)")
    p.add_argument("--work", default=None, help="keep the images and outputs here")
    a = p.parse_args(argv)
    return heldout_eval.main(a.model, (a.lines, a.screenshots, a.pdfs, a.prompt_lines),
                             a.layout, a.json_out, a.work)


if __name__ == "__main__":
    raise SystemExit(main())
