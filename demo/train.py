"""Train the demo OCR model: ``python -m triptych.demo.train --out DIR`` (docs/demo-model.md).

A Qwen2-VL-shaped checkpoint (models/tiny.py's builder, so the engine serves it as any
Qwen2-VL) with a character-level tokenizer, trained from scratch on synthetic printed lines
and short pages (demo/render.py). Every batch goes through the same HF image processor and
chat template the engine uses (api/processor.py), so the served model sees what it learned
on. Seeded; threads set on purpose (``--threads``). Ends with the held-out CER.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from typing import Any

from triptych.demo import render

# Whole phrases the tokenizer keeps as one token each (added tokens): the prompts an OCR job
# sends (jobs/ocr.py's default first) and the template's role names. Every other text is
# one token per character; these would cost ~60 tokens per sample in training otherwise.
PHRASES = ["Transcribe all the text on this page, in reading order.", "Transcribe the text.",
           "What is written here?", "Read the text in this image.", "What does it say?",
           "user\n", "assistant\n", "system\n"]
PROMPTS = [PHRASES[0]] * 6 + PHRASES[1:5] + ["", "ocr", "Read this:"]
# The model's shape: ~1.3M parameters, ~5 MB of float32 (sized for a loaded 2-core CPU).
ARCH = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
            vision_depth=2, vision_embed_dim=128, vision_heads=4)
# ChatML with Qwen2-VL's vision placeholders, as models/tiny.py's, without the default
# system turn: tokens are characters here, and every prompt character costs training time.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] in ('video', 'video_url') %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIN_PIXELS, MAX_PIXELS = 28 * 28, 16 * 24 * 28 * 28  # a 28-px line as is; pages up to 448x672


def char_tokenizer() -> Any:
    """Byte-level tokens without merges: one token per character (ASCII), any text encodes;
    the Qwen2-VL specials and the ChatML template as models/tiny.py writes them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from triptych.models.tiny import SPECIAL_TOKENS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tk.add_tokens([AddedToken(t, normalized=False) for t in PHRASES])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None,
                                  model_max_length=32768)
    tok.chat_template = TEMPLATE
    return tok


def build_skeleton(out: str, seed: int) -> None:
    """A randomly initialised checkpoint of ARCH with the char tokenizer and the demo's
    processor bounds (min/max pixels) written next to it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from triptych.models.tiny import make_tiny_qwen2_vl

    make_tiny_qwen2_vl("qwen2_vl", out, seed=seed, init_std=0.02, tokenizer=char_tokenizer(),
                       max_position_embeddings=4096, **ARCH)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)


class Batcher:
    """Samples -> model inputs, through the checkpoint's own tokenizer, template and processor."""

    def __init__(self, ckpt: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
        self.proc = AutoImageProcessor.from_pretrained(ckpt, local_files_only=True, backend="pil")
        self.pad = self.tok.convert_tokens_to_ids("<|endoftext|>")
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.proc_image_id = self.tok.convert_tokens_to_ids("<|image_pad|>")

    def prompt_ids(self, grid: Any, prompt: str, text_first: bool = False) -> list[int]:
        content = [{"type": "image"}, {"type": "text", "text": prompt}]
        msgs = [{"role": "user", "content": content[::-1] if text_first else content}]
        s = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        n = int(grid.prod()) // 4
        return self.tok.encode(s.replace("<|image_pad|>", "<|image_pad|>" * n),
                               add_special_tokens=False)

    def __call__(self, samples: list[tuple[Any, str]], rng: random.Random) -> dict[str, Any]:
        import torch

        enc = self.proc(images=[im for im, _ in samples], return_tensors="pt")
        rows, labels = [], []
        for (_, text), grid in zip(samples, enc["image_grid_thw"]):
            p = self.prompt_ids(grid, rng.choice(PROMPTS), rng.random() < 0.1)
            t = self.tok.encode(text, add_special_tokens=False) + [self.eos]
            rows.append(p + t)
            labels.append([-100] * len(p) + t)
        n = max(map(len, rows))
        ids = torch.full((len(rows), n), self.pad)
        lab = torch.full((len(rows), n), -100)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, (r, lb) in enumerate(zip(rows, labels)):
            ids[i, :len(r)], lab[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), torch.tensor(lb), 1
        types = (ids == self.proc_image_id).long()
        return dict(input_ids=ids, attention_mask=mask, labels=lab, mm_token_type_ids=types,
                    pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])


def sample(rng: random.Random, frac: float, default_only: bool) -> tuple[Any, str]:
    """Curriculum: lines grow from 4 to 32 characters over the first 40%; short pages
    (2-3 lines on a 280-336 px wide canvas) join after half the run, one sample in 24."""
    if frac > 0.5 and rng.random() < 1 / 24:
        return render.sample_page(rng, n_lines=rng.randint(2, 3), max_chars=rng.randint(8, 24),
                                  width=rng.choice([280, 308, 336]), default_only=default_only)
    max_chars = int(4 + 28 * min(1.0, frac / 0.4))
    return render.sample_line(rng, rng.randint(max(2, max_chars // 3), max_chars),
                              default_only=default_only)


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


def evaluate(model: Any, batcher: Batcher, n: int) -> float:
    """CER over ``n`` held-out lines (render.heldout_lines: a seed training never uses)."""
    import torch

    errs = tot = 0
    with torch.no_grad():
        for img, ref in render.heldout_lines(n):
            e, t = render.cer(greedy(model, batcher, img), ref)
            errs, tot = errs + e, tot + t
    return errs / tot


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    build_skeleton(args.out, args.seed)
    batcher = Batcher(args.out)
    model = Qwen2VLForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    start, avg = time.monotonic(), None
    for step in range(args.steps):
        frac = step / args.steps
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.5 + 0.5 * math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batcher([sample(rng, frac, args.default_font_only) for _ in range(args.batch)], rng)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        avg = loss.item() if avg is None else 0.95 * avg + 0.05 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step} loss {avg:.4f} lr {lr:.2e} {time.monotonic() - start:.0f}s",
                  flush=True)
        if args.save_every and step and step % args.save_every == 0:
            model.save_pretrained(args.out, safe_serialization=True)
    minutes = (time.monotonic() - start) / 60
    model.eval()
    with torch.no_grad():  # float16 values, stored as float32 (the engine's CPU dtype)
        for prm in model.parameters():
            prm.copy_(prm.half().float())
    model.save_pretrained(args.out, safe_serialization=True)
    result = {"steps": args.steps, "batch": args.batch, "seed": args.seed,
              "threads": args.threads, "train_minutes": round(minutes, 1),
              "heldout_lines": args.eval_lines,
              "heldout_cer": round(evaluate(model, batcher, args.eval_lines), 4)}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=340, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and samples")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--default-font-only", action="store_true",
                   help="render with Pillow's default font only (no DejaVu)")
    p.add_argument("--eval-lines", type=int, default=60, help="held-out lines for the CER")
    p.add_argument("--log-every", type=int, default=25, help="steps between loss lines")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
