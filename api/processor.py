"""InputProcessor (P0): prompts and OpenAI-style messages -> token ids + MMItems.

Chat template -> token ids; each `<|image_pad|>` / `<|video_pad|>` placeholder is expanded
to t*h*w/merge**2 tokens (one per vision embedding row); items get their placeholder
offset, pixel values and a content hash. Placeholders are built here and only here: the
engine re-validates them and never trusts a client's.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from triptych.api.media import MediaError, MediaLimits, load_image, load_video
from triptych.api.video import preprocess_video
from triptych.engine.request import MMItem
from triptych.mmcache.hashing import hash_image, hash_video


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_items: list[MMItem] = field(default_factory=list)
    prompt_text: str | None = None


class InputProcessor:
    def __init__(self, model_dir: str, *, limit_mm_per_prompt: dict[str, int] | None = None,
                 media_limits: MediaLimits | None = None, max_model_len: int | None = None,
                 tokenizer: Any | None = None) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # Falls back to the PIL image processor when torchvision is absent (see models/tiny.py).
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.image_token_id, self.video_token_id = cfg.image_token_id, cfg.video_token_id
        self.merge = self.image_processor.merge_size
        self.limits = dict(limit_mm_per_prompt or {"image": 8, "video": 1})
        self.media = media_limits or MediaLimits()
        self.max_model_len = max_model_len
        vcfg_path = os.path.join(model_dir, "video_preprocessor_config.json")
        vcfg = json.load(open(vcfg_path)) if os.path.exists(vcfg_path) else {}
        self.video_min_pixels = vcfg.get("min_pixels", 128 * 28 * 28)
        self.video_max_pixels = vcfg.get("max_pixels", 768 * 28 * 28)
        ip = self.image_processor
        # Everything that changes the processor's output goes into the content hash.
        self.hash_kwargs = {"size": dict(ip.size), "patch": ip.patch_size, "merge": ip.merge_size,
                            "tps": ip.temporal_patch_size, "mean": list(ip.image_mean),
                            "std": list(ip.image_std), "video_pixels": [self.video_min_pixels,
                                                                        self.video_max_pixels]}

    # -- entry points ---------------------------------------------------------------------
    def process_chat(self, messages: list[dict], *, add_generation_prompt: bool = True
                     ) -> ProcessedPrompt:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        media: list[tuple[str, Any]] = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "image_url":
                        url = part.get("image_url")
                        media.append(("image", url.get("url") if isinstance(url, dict) else url))
                    elif kind == "image":
                        media.append(("image", part.get("image")))
                    elif kind == "video_url":
                        url = part.get("video_url")
                        media.append(("video", url.get("url") if isinstance(url, dict) else url))
                    elif kind == "video":
                        media.append(("video", part.get("video")))
                    elif kind != "text":
                        raise ValueError(f"unsupported content part type {kind!r}")
        self._check_limits([k for k, _ in media])
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self._build(text, media)

    def process_prompt(self, prompt: str | list[int] | dict) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return self._build(prompt, [])
        if isinstance(prompt, list):
            if not all(isinstance(t, int) for t in prompt):
                raise ValueError("a token-id prompt must be a list of ints")
            return self._finish(ProcessedPrompt(list(prompt)))
        if isinstance(prompt, dict) and "prompt" in prompt:
            mmd = prompt.get("multi_modal_data") or {}
            media = []
            for kind in ("image", "video"):
                items = mmd.get(kind, [])
                items = items if isinstance(items, list) else [items]
                media += [(kind, x) for x in items]
            unknown = set(mmd) - {"image", "video"}
            if unknown:
                raise ValueError(f"unsupported multi_modal_data keys: {sorted(unknown)}")
            self._check_limits([k for k, _ in media])
            # Order of items follows the order of the placeholders: images first, then videos
            # within the prompt text, each in their list order.
            return self._build(prompt["prompt"], media, by_kind=True)
        raise ValueError("a prompt must be a string, a list of token ids, or "
                         "{'prompt': str, 'multi_modal_data': {...}}")

    # -- internals --------------------------------------------------------------------------
    def _check_limits(self, kinds: list[str]) -> None:
        for kind in ("image", "video"):
            n, limit = kinds.count(kind), self.limits.get(kind, 0)
            if n > limit:
                raise ValueError(f"{n} {kind}(s) in the prompt, but limit_mm_per_prompt allows "
                                 f"{limit} {kind}(s)")

    def _load(self, kind: str, src: Any) -> tuple[torch.Tensor, tuple[int, int, int], str, float | None]:
        if kind == "image":
            img = load_image(src, self.media)
            try:
                out = self.image_processor(images=[img], return_tensors="pt")
            except ValueError as e:  # e.g. aspect ratio above 200
                raise MediaError(f"image cannot be processed: {e}") from None
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            return out["pixel_values"], grid, hash_image(img, self.hash_kwargs), None
        frames, fps = load_video(src, self.media)
        try:
            pv, grid = preprocess_video(frames, self.image_processor,
                                        min_pixels=self.video_min_pixels,
                                        max_pixels=self.video_max_pixels)
        except ValueError as e:
            raise MediaError(f"video cannot be processed: {e}") from None
        tps = self.image_processor.temporal_patch_size
        return (torch.from_numpy(pv), grid, hash_video(frames, self.hash_kwargs, fps), tps / fps)

    def _build(self, text: str, media: list[tuple[str, Any]], by_kind: bool = False
               ) -> ProcessedPrompt:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pads = [i for i, t in enumerate(ids) if t in (self.image_token_id, self.video_token_id)]
        kinds = ["image" if ids[i] == self.image_token_id else "video" for i in pads]
        if by_kind:  # multi_modal_data lists: match placeholders of each kind in order
            queues = {k: [s for kk, s in media if kk == k] for k in ("image", "video")}
            if any(len(queues[k]) != kinds.count(k) for k in queues):
                raise ValueError(f"the prompt has {kinds.count('image')} image and "
                                 f"{kinds.count('video')} video placeholders but "
                                 f"{len(queues['image'])} images and {len(queues['video'])} "
                                 "videos were given")
            media = [(k, queues[k].pop(0)) for k in kinds]
        elif len(media) != len(pads) or [k for k, _ in media] != kinds:
            raise ValueError("the chat template produced placeholders that do not match the "
                             "images/videos given")
        out_ids: list[int] = []
        items: list[MMItem] = []
        prev = 0
        for pos, (kind, src) in zip(pads, media):
            pv, grid, h, spg = self._load(kind, src)
            n = grid[0] * grid[1] * grid[2] // self.merge ** 2
            out_ids += ids[prev:pos]
            items.append(MMItem(kind, h, len(out_ids), n, grid, pv, spg))
            out_ids += [ids[pos]] * n
            prev = pos + 1
        out_ids += ids[prev:]
        return self._finish(ProcessedPrompt(out_ids, items, text))

    def _finish(self, p: ProcessedPrompt) -> ProcessedPrompt:
        if not p.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if self.max_model_len is not None and len(p.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(p.prompt_token_ids)} tokens (images expanded) "
                             f"but max_model_len is {self.max_model_len}")
        return p



__all__ = ["InputProcessor", "ProcessedPrompt"]
