"""InputProcessor (P0): prompts and OpenAI-style messages -> token ids + MMItems.

Chat template -> token ids; each `<|image_pad|>` / `<|video_pad|>` placeholder is expanded
to t*h*w/merge**2 tokens (one per vision embedding row), exactly as HF's Qwen2VLProcessor
expands them; items get their placeholder offset, pixel values and a content hash.
Placeholders are built here and only here: client text may not carry them, and the engine
re-validates what it receives (engine/validate.py).

Images go through HF's PIL image processor; videos through api/video.py (HF's video
processor needs torchvision, see models/tiny.py).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from triptych.api.media import MediaError, MediaLimits, load_image, load_video
from triptych.api.video import preprocess_video
from triptych.engine.request import MMItem
from triptych.mmcache.hashing import hash_image, hash_video

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")
_MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses more; say so before it does


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]  # placeholders already expanded
    mm_items: list[MMItem] = field(default_factory=list)  # in placeholder order
    prompt_text: str | None = None  # the text before expansion (None for token-id prompts)


class InputProcessor:
    """Tokenizer + chat template + image/video preprocessing of one checkpoint directory."""

    def __init__(self, model_dir: str, *, limit_mm_per_prompt: dict[str, int] | None = None,
                 media_limits: MediaLimits | None = None, max_model_len: int | None = None,
                 tokenizer: Any | None = None) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # backend="pil" (use_fast=False before transformers 5): the torchvision one can't load.
        self.image_processor = AutoImageProcessor.from_pretrained(
            model_dir, local_files_only=True, backend="pil")
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.image_token_id, self.video_token_id = cfg.image_token_id, cfg.video_token_id
        self.merge = self.image_processor.merge_size
        self.limits = dict(limit_mm_per_prompt or {"image": 8, "video": 1})
        self.media = media_limits or MediaLimits()
        self.max_model_len = max_model_len
        vcfg_path = os.path.join(model_dir, "video_preprocessor_config.json")
        vcfg: dict[str, Any] = {}
        if os.path.exists(vcfg_path):
            with open(vcfg_path) as f:
                vcfg = json.load(f)
        self.video_min_pixels = vcfg.get("min_pixels", 128 * 28 * 28)
        self.video_max_pixels = vcfg.get("max_pixels", 768 * 28 * 28)
        ip = self.image_processor
        # Everything that changes the processor's output goes into the content hash.
        common = {"patch": ip.patch_size, "merge": ip.merge_size, "tps": ip.temporal_patch_size,
                  "mean": list(ip.image_mean), "std": list(ip.image_std),
                  "rescale": ip.rescale_factor, "resample": int(ip.resample)}
        self.image_hash_kwargs = {**common, "size": dict(ip.size)}
        self.video_hash_kwargs = {**common, "pixels": [self.video_min_pixels, self.video_max_pixels]}
        self._vision_token_ids = {self.tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}

    def for_request(self, media: MediaLimits | None = None, check_length: bool = True
                    ) -> InputProcessor:
        """A view for one request: its media limits (lowered caps, pixel budget) and, for a
        prompt the server truncates afterwards, no length check. Tokenizer and processors
        are shared, not copied."""
        view = copy.copy(self)
        view.media = media or self.media
        view.max_model_len = self.max_model_len if check_length else None
        return view

    # -- entry points ---------------------------------------------------------------------
    def process_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        """OpenAI-style messages (content a string or text/image/image_url/video/video_url
        parts, any turn) -> expanded token ids and one MMItem per image/video."""
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
        media: list[tuple[str, Any]] = []
        for m in messages:
            if not isinstance(m.get("role"), str):
                raise ValueError("every message needs a string 'role'")
            content = m.get("content")
            if content is None or isinstance(content, str):
                self._check_text(content or "")
                continue
            if not isinstance(content, list):
                raise ValueError("message content must be a string or a list of parts")
            for part in content:
                media += self._parse_part(part)
        self._check_limits([k for k, _ in media])
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        return self._build(text, media)

    def process_prompt(self, prompt: str | list[int] | dict) -> ProcessedPrompt:
        """A string, token ids, or {'prompt': str, 'multi_modal_data': {'image': PIL|list,
        'video': ndarray|list}} whose text holds one vision placeholder per item."""
        if isinstance(prompt, str):
            return self._build(prompt, [], by_kind=True)
        if isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("a token-id prompt must be a list of ints")
            return self._finish(ProcessedPrompt(list(prompt)))
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            mmd = prompt.get("multi_modal_data") or {}
            if not isinstance(mmd, dict):
                raise ValueError("multi_modal_data must be a mapping of modality -> items")
            unknown = set(mmd) - {"image", "video"}
            if unknown:
                raise ValueError(f"unsupported multi_modal_data keys: {sorted(unknown)}")
            media = []
            for kind in ("image", "video"):
                items = mmd.get(kind, [])
                items = items if isinstance(items, list) else [items]
                media += [(kind, x) for x in items]
            self._check_limits([k for k, _ in media])
            return self._build(prompt["prompt"], media, by_kind=True)
        raise ValueError("a prompt must be a string, a list of token ids, or "
                         "{'prompt': str, 'multi_modal_data': {...}}")

    # -- parsing --------------------------------------------------------------------------
    def _parse_part(self, part: Any) -> list[tuple[str, Any]]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            self._check_text(part.get("text"))
            return []
        if kind in ("image_url", "video_url"):
            url = part.get(kind)
            return [(kind[:5], url.get("url") if isinstance(url, dict) else url)]
        if kind in ("image", "video"):
            return [(kind, part.get(kind))]
        raise ValueError(f"unsupported content part type {kind!r}" if isinstance(kind, str)
                         else "every content part needs a string 'type'")

    def _check_text(self, text: Any) -> None:
        if not isinstance(text, str):
            raise ValueError("text content must be a string")
        # NOTE: a client's text must not smuggle placeholders in: only media parts make them.
        if any(t in text for t in VISION_TOKENS):
            raise ValueError("message text may not contain vision placeholder tokens "
                             "(<|image_pad|>, <|video_pad|>, <|vision_start|>, ...); "
                             "send images and videos as content parts")

    def _check_limits(self, kinds: list[str]) -> None:
        for kind in ("image", "video"):
            n, limit = kinds.count(kind), self.limits.get(kind, 0)
            if n > limit:
                raise ValueError(f"{n} {kind}(s) in the prompt, but limit_mm_per_prompt allows "
                                 f"{limit} {kind}(s)")

    # -- media ----------------------------------------------------------------------------
    def _load(self, kind: str, src: Any) -> MMItem:
        """Decode + preprocess one item; offset/length are filled in by _build."""
        ip = self.image_processor
        if kind == "image":
            img = load_image(src, self.media)
            w, h = img.size
            if max(w, h) > _MAX_ASPECT_RATIO * min(w, h):
                raise MediaError(f"image is {w}x{h}: aspect ratio above {_MAX_ASPECT_RATIO}")
            out = ip(images=[img], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            return MMItem("image", hash_image(img, self.image_hash_kwargs), 0, 0, grid,
                          out["pixel_values"])
        frames, fps = load_video(src, self.media)
        h, w = frames.shape[1:3]
        if max(w, h) > _MAX_ASPECT_RATIO * min(w, h):
            raise MediaError(f"video is {w}x{h}: aspect ratio above {_MAX_ASPECT_RATIO}")
        pv, grid = preprocess_video(frames, ip, min_pixels=self.video_min_pixels,
                                    max_pixels=self.video_max_pixels)
        return MMItem("video", hash_video(frames, self.video_hash_kwargs, fps), 0, 0, grid,
                      torch.from_numpy(pv), ip.temporal_patch_size / fps)

    # -- expansion ------------------------------------------------------------------------
    def _build(self, text: str, media: list[tuple[str, Any]], by_kind: bool = False
               ) -> ProcessedPrompt:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pads = [i for i, t in enumerate(ids) if t in (self.image_token_id, self.video_token_id)]
        kinds = ["image" if ids[i] == self.image_token_id else "video" for i in pads]
        if by_kind:  # multi_modal_data lists: match placeholders of each kind in order
            queues = {k: [s for kk, s in media if kk == k] for k in ("image", "video")}
            if any(len(queues[k]) != kinds.count(k) for k in queues):
                raise ValueError(
                    f"the prompt has {kinds.count('image')} image and {kinds.count('video')} "
                    f"video placeholders but {len(queues['image'])} images and "
                    f"{len(queues['video'])} videos were given; put "
                    "<|vision_start|><|image_pad|><|vision_end|> (or <|video_pad|>) in the "
                    "prompt once per item")
            media = [(k, queues[k].pop(0)) for k in kinds]
        elif [k for k, _ in media] != kinds:
            raise ValueError("the chat template produced placeholders that do not match the "
                             "images/videos given")
        # Fail before decoding any media when the text alone cannot fit.
        self._check_len(len(ids) - len(pads))
        out_ids: list[int] = []
        items: list[MMItem] = []
        prev = 0
        for pos, (kind, src) in zip(pads, media):
            item = self._load(kind, src)
            t, h, w = item.grid_thw
            out_ids += ids[prev:pos]
            item.offset, item.length = len(out_ids), t * h * w // self.merge ** 2
            items.append(item)
            out_ids += [ids[pos]] * item.length
            prev = pos + 1
        out_ids += ids[prev:]
        return self._finish(ProcessedPrompt(out_ids, items, text))

    def _check_len(self, n: int) -> None:
        # NOTE: `>=`: prompt + at least one output token must fit (engine/validate.py agrees).
        if self.max_model_len is not None and n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens (images/videos expanded) but "
                             f"max_model_len is {self.max_model_len}")

    def _finish(self, p: ProcessedPrompt) -> ProcessedPrompt:
        if not p.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self._check_len(len(p.prompt_token_ids))
        return p


__all__ = ["InputProcessor", "ProcessedPrompt"]
