"""Image preparation, step by step: ``python -m triptych.bench.prep``.

What P0 (or a preparation process) spends on one image before the model sees it, in CPU
milliseconds, per image size and per architecture's processor settings:

- decode: the encoded JPEG to 8-bit RGB (api/media/decode.py, api/media/pixels.py);
- hash: the item's key over the encoded bytes (what the server hashes), and, for a PIL
  image given in Python, over its pixels: ``hash_image`` (``tobytes`` + blake2b, the way
  before issue 41) and ``hash_pixels`` (blake2b over the RGB array the fast path reads,
  in place; the one copy out of Pillow is counted in the fast step, which reuses it);
- HF: the checkpoint's HF image processor on the PIL image (``--mm-preprocessor hf``);
- fast: the fast path on the same image (``--mm-preprocessor fast``, models/image_ops.py),
  the copy out of Pillow included;
- fast into kept: the fast path writing into the same buffer call after call, as it
  would into a shared-memory slot (``out=``): the same work without faulting in a fresh
  output's pages, which glibc maps anew for every block above 32 MB;
- prepare: decode + hash of the bytes + each preprocessor: an image sent to the server.

Steps run in alternating rounds after one uncounted round (each round runs every step
once, HF and fast in turns first), figures are medians over the rounds; ``time.process_time`` of this process with
``--threads`` torch threads (1: how P0 and preparation processes run). The images are
synthetic photos (smooth colour fields, shapes and sensor-like noise, JPEG quality 90),
so decode costs what a camera's JPEG of that size costs, give or take. The processor
settings are the hub checkpoints': Qwen2-VL-2B's (max_pixels 12,845,056) and the capped
1,003,520 the issue measured, Qwen3-VL's (patch 16, 65,536..16,777,216 px), InternVL3's
(448 px tiles, up to 12 plus a thumbnail). The machine may be shared: compare ratios
taken in one run.

Importable for other drivers (the server-driven half, ``triptych bench prep``): ``photo``,
``SETUPS``, ``measure``, ``format_rows``.
"""
from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

DEFAULT_SIZES = ((640, 480), (1920, 1080), (3840, 2160))
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def photo(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    """A synthetic photo as JPEG bytes: smooth colour fields, a few soft-edged shapes and
    sensor-like noise, so it decodes and compresses like a camera image of its size."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / width * np.pi * (1 + c) + c + y / height * 2)
                     for c in range(3)], -1)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(24):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        r = int(rng.integers(max(2, width // 40), max(3, width // 6)))
        draw.ellipse((x0 - r, y0 - r, x0 + r, y0 + r),
                     fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    img = img.filter(ImageFilter.GaussianBlur(2))
    noisy = np.asarray(img).astype(np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@dataclass
class Setup:
    """One architecture's processor settings: its contract, HF's image processor, and the
    bit of HF config the contract reads (InternVL's patch size)."""

    name: str
    model_type: str
    make: Callable[[], Any]
    hf: Any = field(default_factory=lambda: SimpleNamespace(
        vision_config=SimpleNamespace(patch_size=14)))


def _qwen2(max_pixels: int) -> Callable[[], Any]:
    def make() -> Any:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
        return Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=max_pixels,
                                        image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))
    return make


def _qwen3() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 65536, "longest_edge": 16777216},
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _internvl() -> Any:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )
    return GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, min_patches=1,
                                    max_patches=12, image_mean=list(IMAGENET_MEAN),
                                    image_std=list(IMAGENET_STD))


SETUPS = {s.name: s for s in (
    Setup("qwen2-vl", "qwen2_vl", _qwen2(12845056)),  # the hub's max_pixels
    Setup("qwen2-vl-1m", "qwen2_vl", _qwen2(1003520)),  # capped, as the issue measured
    Setup("qwen3-vl", "qwen3_vl", _qwen3),
    Setup("internvl", "internvl", _internvl),
)}


@dataclass
class Row:
    """Median CPU ms of each step for one image size (and one setup, for the processors)."""

    size: tuple[int, int]
    setup: str | None
    ms: dict[str, float]


def _cpu_ms(fn: Callable[[], Any]) -> float:
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1000


def measure(sizes: tuple[tuple[int, int], ...] = DEFAULT_SIZES,
            setups: list[str] | None = None, rounds: int = 5) -> list[Row]:
    """Each step's median CPU ms over ``rounds`` alternating rounds (see the module's
    docstring). Rows: one per size (decode, hashes), one per (size, setup) (HF, fast)."""
    import torch
    from triptych.api.media.decode import decode_image
    from triptych.api.media.limits import MediaLimits
    from triptych.mmcache.hashing import hash_image, hash_media_bytes, hash_pixels
    from triptych.models.contract import contract_for_type
    from triptych.models.image_ops import rgb_array

    chosen = [SETUPS[n] for n in (setups or list(SETUPS))]
    procs = {s.name: (contract_for_type(s.model_type), s.make(), s.hf) for s in chosen}
    limits = MediaLimits(max_image_pixels=1 << 28, max_image_bytes=1 << 30)
    kw = {"bench": True}
    samples: dict[tuple[Any, ...], list[float]] = {}
    for (w, h) in sizes:
        data = photo(w, h)
        img = decode_image(data, limits)
        rgb = rgb_array(img)
        steps: list[tuple[tuple[Any, ...], Callable[[], Any]]] = [
            (((w, h), None, "decode"), lambda: decode_image(data, limits)),
            (((w, h), None, "hash bytes"), lambda: hash_media_bytes("image", data, kw)),
            (((w, h), None, "hash PIL (tobytes)"), lambda: hash_image(img, kw)),
            (((w, h), None, "hash pixels"), lambda: hash_pixels(rgb, kw)),
        ]
        for name, (contract, ip, hf) in procs.items():
            for mode in ("hf", "fast"):
                steps.append((((w, h), name, mode),
                              lambda c=contract, ip=ip, hf=hf, m=mode:
                              c.preprocess_image(ip, img, hf, m)))
            # into a buffer kept from call to call, as a shared-memory slot would be: no
            # fresh pages to fault in (a new 50 MB tensor costs ~as much as the lookup)
            kept = torch.empty(contract.pixel_shape(ip, hf, h, w))
            steps.append((((w, h), name, "fast into kept"),
                          lambda c=contract, ip=ip, hf=hf, out=kept:
                          c.preprocess_image(ip, img, hf, "fast", out)))
        for _, fn in steps:  # a round not counted: lazy imports, tables, the kernel's load
            fn()
        for r in range(rounds):
            # HF and fast take turns at going first; other steps keep their order
            order = steps if r % 2 == 0 else _swap_pairs(steps)
            for key, fn in order:
                samples.setdefault(key, []).append(_cpu_ms(fn))
        del rgb
    rows: dict[tuple[Any, ...], Row] = {}
    for (size, setup, step), vals in samples.items():
        row = rows.setdefault((size, setup), Row(size, setup, {}))
        row.ms[step] = statistics.median(vals)
    return list(rows.values())


def _swap_pairs(steps: list[Any]) -> list[Any]:
    """The step list with each (hf, fast) pair in the other order."""
    out = list(steps)
    for i in range(len(out) - 1):
        if out[i][0][2] == "hf" and out[i + 1][0][2] == "fast":
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def format_rows(rows: list[Row]) -> str:
    """Two tables (plain text, Markdown-compatible): decode and hashes per size; then per
    size and setup HF, fast, fast / HF and what preparing a sent JPEG costs each way."""
    out = ["| image | decode | hash bytes | hash PIL (tobytes) | hash pixels |",
           "|---|---|---|---|---|"]
    base = {r.size: r.ms for r in rows if r.setup is None}
    for size, ms in base.items():
        out.append(f"| {size[0]}x{size[1]} | {ms['decode']:.1f} | {ms['hash bytes']:.2f} | "
                   f"{ms['hash PIL (tobytes)']:.1f} | {ms['hash pixels']:.1f} |")
    out += ["", "| image | processor | HF | fast | fast / HF | fast into kept | prepare HF "
            "| prepare fast |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.setup is None:
            continue
        pre = base[r.size]["decode"] + base[r.size]["hash bytes"]
        out.append(f"| {r.size[0]}x{r.size[1]} | {r.setup} | {r.ms['hf']:.1f} | "
                   f"{r.ms['fast']:.1f} | {r.ms['fast'] / r.ms['hf']:.2f} | "
                   f"{r.ms['fast into kept']:.1f} | {pre + r.ms['hf']:.1f} | "
                   f"{pre + r.ms['fast']:.1f} |")
    return "\n".join(out)


def machine() -> str:
    """The CPU, core count and library versions, for the record."""
    import os

    import PIL
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f
                        if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__} "
            f"({torch.get_num_threads()} thread(s)), Pillow {PIL.__version__}, "
            f"transformers {transformers.__version__}")


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in DEFAULT_SIZES),
                   help="image sizes, WxH, comma-separated")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"processor settings, comma-separated, of: {', '.join(SETUPS)}")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sizes = tuple(_size(s) for s in args.sizes.split(","))
    setups = [s.strip() for s in args.setups.split(",")]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        p.error(f"unknown setup {unknown[0]!r}: use one of {', '.join(SETUPS)}")
    rows = measure(sizes, setups, args.rounds)
    print(f"CPU ms per image, medians of {args.rounds} alternating rounds; {machine()}")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rounds": args.rounds,
                       "rows": [{"size": list(r.size), "setup": r.setup, "ms": r.ms}
                                for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
