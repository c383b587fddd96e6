"""The demo model's training data, batch by batch (demo/train.py): samples rendered on the
fly (demo/render.py), turned into model inputs through the checkpoint's own tokenizer,
chat template and image processor, and made one step ahead on a thread."""
from __future__ import annotations

import argparse
import random
from typing import Any

from triptych.demo import augment, render, template

# Whole phrases the tokenizer keeps as one special token each: the prompts an OCR job sends
# (jobs/ocr.py's default first) and the template's role names. Every other text is one
# token per character; these would cost ~60 tokens per sample in training otherwise.
PHRASES = [template.INSTRUCTION, "Transcribe the text.",
           "What is written here?", "Read the text in this image.", "What does it say?",
           "user\n", "assistant\n", "system\n"]
PROMPTS = [PHRASES[0]] * 6 + PHRASES[1:5] + ["", "ocr", "Read this:"]


class Batcher:
    """Samples -> model inputs, through the checkpoint's own tokenizer, template and processor."""

    def __init__(self, ckpt: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
        # Training renders its drawn prompts (template.TRAIN); the checkpoint serves its
        # single instruction whatever the prompt (template.SERVE).
        self.tok.chat_template = template.TRAIN
        self.proc = AutoImageProcessor.from_pretrained(ckpt, local_files_only=True, backend="pil")
        self.pad = self.tok.convert_tokens_to_ids("<|endoftext|>")
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.proc_image_id = self.tok.convert_tokens_to_ids("<|image_pad|>")

    def label_ids(self, text: str) -> list[int]:
        """A transcription's target ids: its characters (a phrase token such as "user\n" is
        template text, never an answer's: split_special_tokens) and the closing EOS."""
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True) + \
            [self.eos]

    def prompt_ids(self, grid: Any, prompt: str, text_first: bool = False) -> list[int]:
        content = [{"type": "image"}, {"type": "text", "text": prompt}]
        msgs = [{"role": "user", "content": content[::-1] if text_first else content}]
        s = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        n = int(grid.prod()) // 4
        return self.tok.encode(s.replace("<|image_pad|>", "<|image_pad|>" * n),
                               add_special_tokens=False)

    def __call__(self, samples: list[tuple[Any, str]], rng: random.Random,
                 keep: slice = slice(None)) -> dict[str, Any]:
        """The inputs of ``samples[keep]``; every sample's prompt is drawn from ``rng``
        all the same, so a rank keeping its share draws what the whole batch draws."""
        import torch

        prompts = [(rng.choice(PROMPTS), rng.random() < 0.1) for _ in samples][keep]
        samples = samples[keep]
        enc = self.proc(images=[im for im, _ in samples], return_tensors="pt")
        rows, labels = [], []
        for (_, text), grid, (prompt, text_first) in zip(samples, enc["image_grid_thw"], prompts):
            p = self.prompt_ids(grid, prompt, text_first)
            t = self.label_ids(text)
            rows.append(p + t)
            labels.append([-100] * len(p) + t)
        n = max(map(len, rows))
        ids = torch.full((len(rows), n), self.pad)
        lab = torch.full((len(rows), n), -100)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, (r, lb) in enumerate(zip(rows, labels)):
            ids[i, :len(r)], lab[i, :len(r)] = torch.tensor(r), torch.tensor(lb)
            mask[i, :len(r)] = 1
        types = (ids == self.proc_image_id).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": lab,
                "mm_token_type_ids": types, "pixel_values": enc["pixel_values"],
                "image_grid_thw": enc["image_grid_thw"]}


def sample(rng: random.Random, frac: float, args: argparse.Namespace, page: bool = False
           ) -> tuple[Any, str, list[list[list[int]]]]:
    """Curriculum: lines grow from 1 to 32 characters over the first ``--ramp`` of the run
    (a line of one or two characters teaches the glyphs before alignment matters); short
    pages (2-3 lines on a 280-336 px wide canvas, ``page``) join after ``--pages-from`` of
    the run. ``--random-share`` of the lines are random characters. ``--strips`` of the
    lines are printed broadly and read back through `triptych ocr`'s layout step
    (demo/augment.py), up to 40 characters.
    Returns (image, transcription, the characters each merged vision token shows)."""
    cols: list[list[list[int]]] = []
    if page:
        img, text = render.sample_page(rng, n_lines=rng.randint(2, 3),
                                       max_chars=rng.randint(8, 24),
                                       width=rng.choice([280, 308, 336]),
                                       default_only=args.default_font_only,
                                       crop=getattr(args, "crop_pages", False), columns=cols)
        return img, text, cols
    if getattr(args, "strips", 0.0) and rng.random() < args.strips:
        img, text = augment.sample(rng, rng.randint(4, 40), columns=cols)
        return img, text, cols
    max_chars = int(1 + 31 * min(1.0, frac / args.ramp)) if args.ramp > 0 else 32
    img, text = render.sample_line(rng, rng.randint(max(1, max_chars // 3), max_chars),
                                   default_only=args.default_font_only,
                                   random_share=args.random_share, columns=cols)
    return img, text, cols


def is_page_step(step: int, args: argparse.Namespace) -> bool:
    """Pages come in batches of their own (an eighth of --batch), so that lines are not
    padded to a page's length: every --page-every-th step once pages have joined."""
    return step / args.steps >= args.pages_from and step % args.page_every == 0


def step_samples(start: int, stop: int, args: argparse.Namespace, rng: random.Random
                 ) -> list[list[tuple[Any, str, list[list[list[int]]]]]]:
    """The samples of steps ``start`` to ``stop`` - 1, drawn in step order. With ``--bucket``
    above 1 the line samples of those steps are pooled, sorted by length (text characters
    plus vision tokens) and dealt back as batches of alike lengths in a random order: a
    batch is padded to its longest row, and unsorted half of a batch's tokens were padding."""
    out = []
    for step in range(start, stop):
        page = is_page_step(step, args)
        out.append([sample(rng, step / args.steps, args, page)
                    for _ in range(max(1, args.batch // 8) if page else args.batch)])
    lines = [i for i in range(stop - start) if not is_page_step(start + i, args)]
    if getattr(args, "bucket", 1) > 1 and len(lines) > 1:
        pool = sorted((s for i in lines for s in out[i]),
                      key=lambda s: len(s[1]) + s[0].width // render.ROW)
        chunks = [pool[k * args.batch:(k + 1) * args.batch] for k in range(len(lines))]
        rng.shuffle(chunks)
        for i, chunk in zip(lines, chunks):
            out[i] = chunk
    return out


def make_inputs(samples: list[tuple[Any, str, list[list[list[int]]]]], batcher: Batcher,
                teacher: Any, rng: random.Random, model: Any = None, procs: int = 1,
                rank: int = 0) -> tuple[list[Any], dict[str, Any], Any]:
    """(samples, model inputs, glyph targets) of this rank's share of ``samples`` (all of
    them with one process). With ``model``, the inputs carry their M-RoPE position ids
    (computed here, on the producer's thread, instead of in the forward)."""
    n = len(samples) // procs
    keep = slice(rank * n, (rank + 1) * n)
    batch = batcher([(img, text) for img, text, _ in samples], rng, keep)
    samples = samples[keep]
    if model is not None:
        batch["position_ids"], _ = model.model.get_rope_index(
            batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
            image_grid_thw=batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    return samples, batch, teacher.targets(samples)


def step_groups(args: argparse.Namespace) -> tuple[int, int, int]:
    """(steps the run draws, steps in a group drawn together (``--bucket``), groups)."""
    total = min(args.steps, args.max_steps or args.steps)
    size = max(1, getattr(args, "bucket", 1))
    return total, size, -(-total // size)


def local_items(args: argparse.Namespace, batcher: Batcher, teacher: Any,
                rng: random.Random, model: Any = None) -> Any:
    """Every step's (samples, inputs, glyph targets), drawn from ``rng`` in step order."""
    total, group, _ = step_groups(args)
    for start in range(0, total, group):
        for samples in step_samples(start, min(start + group, total), args, rng):
            yield make_inputs(samples, batcher, teacher, rng, model,
                              getattr(args, "procs", 1), getattr(args, "rank", 0))


def prefetch(args: argparse.Namespace, source: Any) -> Any:
    """The batches of ``source`` (``local_items``, or demo/data_procs.py ``items`` with
    ``--data-procs``), made ahead on a thread of this process (rendering and the image
    processor mostly run outside the GIL, beside the forward and backward). One thread
    draws every sample in step order, so the data are those of a loop without it. With
    ``--procs`` above 1 every rank draws the whole step and keeps its share (``args.rank``):
    the ranks' samples are one process's. With ``--data-procs`` N the thread reads the
    batches that N processes make (another draw)."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=2)
    done = threading.Event()
    pin = getattr(args, "device", "cpu") != "cpu"
    failed: list[BaseException] = []

    def produce() -> None:
        try:
            for item in source:
                if pin:  # page-locked here, so the step's copy to the GPU does not wait
                    item = (item[0], {k: v.pin_memory() for k, v in item[1].items()},
                            item[2].pin_memory())
                while not done.is_set():
                    try:
                        q.put(item, timeout=1.0)
                        break
                    except queue.Full:
                        continue
                if done.is_set():
                    return
        except BaseException as e:  # the training loop raises it instead of waiting
            failed.append(e)
        finally:
            source.close()

    threading.Thread(target=produce, name="batches", daemon=True).start()
    try:
        waited = 0
        while True:
            try:
                yield q.get(timeout=1.0)
                waited = 0
            except queue.Empty:
                if failed:
                    raise failed[0]
                waited += 1
                if waited >= 600:
                    raise TimeoutError("no batch for 600 s: the producer is stuck")
    finally:
        done.set()
