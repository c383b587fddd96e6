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
    ids = torch.tensor([batcher.prompt_ids(enc["image_grid_thw"][0], PROMPTS[0])])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == batcher.proc_image_id).long(),
                         pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
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
