"""InputProcessor (P0): prompts and OpenAI-style messages -> token ids + MMItems.

Chat template -> token ids; each image/video placeholder the template wrote is expanded to
t*h*w/merge**2 tokens (one per encoder payload row), wrapped as the model contract says
(InternVL: <img> ... </img>); items get their placeholder offset, pixel values and a
content hash. Placeholders are built here and only here: client text may not carry them,
and the engine re-validates what it receives (engine/validate.py).

Images go through the model contract's preprocessing (``--mm-preprocessor``: the fast
path, models/image_ops.py, or HF's image processor); videos through
api/media/video.py (HF's video processor needs torchvision, see models/tiny.py). A model
whose contract sets ``video_timestamps`` (Qwen3-VL) gets each video as one item per
temporal group, each span after its ``<t seconds>`` text, as Qwen3VLProcessor builds it.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

from triptych.api.media.decode import (
    MediaError,
    MediaLimits,
)
from triptych.api.sampling_checks import context_message
from triptych.api.template_parts import template_messages
from triptych.engine.request import MMItem
from triptych.api.media_items import MediaItems, MediaSource, _Counts
from triptych.mmcache.index import ProcessorCacheIndex
from triptych.router.prompt import ProcessedPrompt

class InputProcessor(MediaItems):
    """Tokenizer + chat template + image/video preprocessing of one checkpoint directory.

    With a ``cache`` (``ProcessorCacheIndex``), an item whose key the index holds is not
    decoded or processed: it leaves with ``pixel_values=None`` and the metadata the prompt
    needs, and its ``MediaSource`` stays on the prompt for ``load_pixels``. The key is
    computed before decoding: from the encoded bytes, the client's ``uuid``, or (PIL images
    and frame arrays, which have no bytes) the pixels.
    """

    def __init__(self, model_dir: str, *, limit_mm_per_prompt: dict[str, int] | None = None,
                 media_limits: MediaLimits | None = None, max_model_len: int | None = None,
                 tokenizer: Any | None = None, cache: ProcessorCacheIndex | None = None,
                 mm_preprocessor: str = "fast") -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # backend="pil" (use_fast=False before transformers 5): the torchvision one can't load.
        self.image_processor = AutoImageProcessor.from_pretrained(
            model_dir, local_files_only=True, backend="pil")
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.image_token_id = cfg.image_token_id
        self.video_token_id = getattr(cfg, "video_token_id", None)
        from triptych.models.contract import contract_for

        self.hf_config = cfg
        self.contract = contract = contract_for(cfg)
        self.modalities = contract.modalities  # what the model contract takes
        self.merge = contract.spatial_merge_size(cfg)
        self.wrappers = contract.span_wrappers(self.tokenizer)  # ids around each span
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
        self.video_frame_cap_tokens: int | None = None  # Qwen3-VL's cap (api/media/video.py)
        if contract.video_timestamps:  # Qwen3-VL: one budget for the whole clip, in `size`
            size = vcfg.get("size") or {}
            self.video_min_pixels = size.get("shortest_edge", 128 * 32 * 32)
            self.video_max_pixels = size.get("longest_edge", 768 * 32 * 32)
            if vcfg.get("cap_pixels_per_frame"):
                self.video_frame_cap_tokens = int(vcfg.get("max_video_tokens", 768))
        ip = self.image_processor
        # Everything that changes the processor's output goes into the content hash (the
        # contract names the settings: tiling models add their crop settings).
        self.image_hash_kwargs = contract.image_hash_kwargs(ip)
        self.video_hash_kwargs: dict[str, Any] = {}
        if "video" in self.modalities:
            common = {k: v for k, v in self.image_hash_kwargs.items() if k != "size"}
            cap = self.video_frame_cap_tokens
            self.video_hash_kwargs = {**common,
                                      "pixels": [self.video_min_pixels, self.video_max_pixels],
                                      **({"frame_cap": cap} if cap else {})}
        self.placeholder_tokens = contract.placeholder_tokens
        self._vision_token_ids = {self.tokenizer.convert_tokens_to_ids(t)
                                  for t in self.placeholder_tokens}
        self.cache = cache
        self.mm_preprocessor = mm_preprocessor  # "fast" | "hf" (--mm-preprocessor)
        # NOTE: one counters object, shared with the per-request views of for_request (a
        # shallow copy): counts made through a view land here.
        self.counts = _Counts()
        # An engine in this process (the offline LLM) sets this: hits then take their
        # pixels from its store, so every prompt handed out is complete.
        self.fill_pixels: Any = None
        self.scope = ""  # whose uuids this view resolves (api/tenancy.py); "" = shared

    def for_request(self, media: MediaLimits | None = None, check_length: bool = True,
                    scope: str = "", tenant: str | None = None) -> InputProcessor:
        """A view for one request: its media limits (lowered caps, pixel budget), for a
        prompt the server truncates afterwards no length check, the ``scope`` its uuids
        live in (tenant + cache_salt) and its ``tenant`` (whose turn its media preparation
        takes). Tokenizer and processors are shared."""
        view = copy.copy(self)
        view.media = media or self.media
        view.max_model_len = self.max_model_len if check_length else None
        view.scope, view.tenant = scope, tenant
        return view

    def _hash_kwargs(self, kind: str) -> dict[str, Any]:
        """Everything of this view that changes a ``kind`` item's pixels: the processor's
        settings and, for videos, how frames are sampled (a request may lower the caps)."""
        if kind == "image":
            return self.image_hash_kwargs
        return {**self.video_hash_kwargs, "fps": self.media.video_fps,
                "max_frames": self.media.max_video_frames}

    # -- entry points ---------------------------------------------------------------------
    def process_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        """OpenAI-style messages (content a string or text/image/image_url/video/video_url
        parts, any turn) -> expanded token ids and one MMItem per image/video."""
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
        media: list[tuple[str, Any, str | None]] = []
        fields: list[str] = []  # the request field of each media item, for refusals
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError("every message needs a string 'role'")
            content = m.get("content")
            if content is None or isinstance(content, str):
                self._check_text(content or "")
                continue
            if not isinstance(content, list):
                raise ValueError("message content must be a string or a list of parts")
            for j, part in enumerate(content):
                found = self._parse_part(part)
                media += found
                fields += [f"messages.{i}.content.{j}.{part['type']}"] * len(found)
        self._check_limits([k for k, _, _ in media])
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        return self._build(text, media, fields=fields)

    def process_prompt(self, prompt: str | list[int] | dict) -> ProcessedPrompt:
        """A string, token ids, or {'prompt': str, 'multi_modal_data': {'image': PIL|list,
        'video': ndarray|list}} whose text holds one vision placeholder per item; optional
        'multi_modal_uuids' ({'image': [uuid or None, ...]}) name items as content parts'
        uuids do (an item may then be None if the uuid was seen before)."""
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
            uuids = prompt.get("multi_modal_uuids") or {}
            if not isinstance(uuids, dict) or set(uuids) - set(mmd):
                raise ValueError("multi_modal_uuids must map modalities of multi_modal_data to "
                                 "lists of uuids (or None)")
            media = []
            for kind in ("image", "video"):
                items = mmd.get(kind, [])
                items = items if isinstance(items, list) else [items]
                ids = uuids.get(kind, [None] * len(items))
                ids = ids if isinstance(ids, list) else [ids]
                if len(ids) != len(items):
                    raise ValueError(f"multi_modal_uuids has {len(ids)} {kind} uuid(s) for "
                                     f"{len(items)} {kind}(s)")
                for x, u in zip(items, ids):
                    if u is not None and not isinstance(u, str):
                        raise ValueError("a uuid must be a string")
                    media.append((kind, x, u))
            self._check_limits([k for k, _, _ in media])
            return self._build(prompt["prompt"], media, by_kind=True)
        raise ValueError("a prompt must be a string, a list of token ids, or "
                         "{'prompt': str, 'multi_modal_data': {...}}")

    # -- parsing --------------------------------------------------------------------------
    def _parse_part(self, part: Any) -> list[tuple[str, Any, str | None]]:
        """-> [(modality, source or None, uuid or None)]; a part with a ``uuid`` may leave
        its data out (``"image_url": {}`` or null) when the server already holds it."""
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            self._check_text(part.get("text"))
            return []
        if kind in ("image_url", "video_url", "image", "video"):
            uuid = part.get("uuid")
            if uuid is not None and not isinstance(uuid, str):
                raise ValueError("a content part's uuid must be a string")
            src = part.get(kind)
            if kind.endswith("_url") and isinstance(src, dict):
                src = src.get("url")
            if src is None and uuid is None:
                raise ValueError(f"a {kind} part needs its data (or a uuid sent before)")
            return [(kind.removesuffix("_url"), src, uuid)]
        raise ValueError(f"unsupported content part type {kind!r}" if isinstance(kind, str)
                         else "every content part needs a string 'type'")

    def _check_text(self, text: Any) -> None:
        if not isinstance(text, str):
            raise ValueError("text content must be a string")
        # NOTE: a client's text must not smuggle placeholders in: only media parts make them.
        if any(t in text for t in self.placeholder_tokens):
            raise ValueError(f"message text may not contain vision placeholder tokens "
                             f"({', '.join(self.placeholder_tokens)}); "
                             "send images and videos as content parts")

    def _check_limits(self, kinds: list[str]) -> None:
        for kind in sorted(set(kinds) - set(self.modalities)):
            raise ValueError(f"this model ({', '.join(self.modalities)} only) does not take "
                             f"{kind} input yet")
        for kind in ("image", "video"):
            n, limit = kinds.count(kind), self.limits.get(kind, 0)
            if n > limit:
                raise ValueError(f"{n} {kind}(s) in the prompt, but limit_mm_per_prompt allows "
                                 f"{limit} {kind}(s)")

    # -- expansion ------------------------------------------------------------------------
    def _build(self, text: str, media: list[tuple[str, Any, str | None]], by_kind: bool = False,
               fields: list[str] | None = None) -> ProcessedPrompt:
        """``fields`` (chat): the request field of each item in ``media``, named by a
        refusal of that item (MediaError.param)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pads = [i for i, t in enumerate(ids) if t in (self.image_token_id, self.video_token_id)]
        kinds = ["image" if ids[i] == self.image_token_id else "video" for i in pads]
        if by_kind:  # multi_modal_data lists: match placeholders of each kind in order
            queues = {k: [m for m in media if m[0] == k] for k in ("image", "video")}
            if any(len(queues[k]) != kinds.count(k) for k in queues):
                raise ValueError(
                    f"the prompt has {kinds.count('image')} image and {kinds.count('video')} "
                    f"video placeholders but {len(queues['image'])} images and "
                    f"{len(queues['video'])} videos were given; put "
                    "<|vision_start|><|image_pad|><|vision_end|> (or <|video_pad|>) in the "
                    "prompt once per item")
            media = [queues[k].pop(0) for k in kinds]
        elif [k for k, _, _ in media] != kinds:
            raise ValueError("the chat template produced placeholders that do not match the "
                             "images/videos given")
        # Fail before decoding any media when the text alone cannot fit.
        self._check_len(len(ids) - len(pads))
        sources: list[MediaSource] = []
        try:
            return self._expand(ids, pads, media, fields, text, sources)
        except BaseException:
            for done in sources:  # what the items made so far hold in shared memory
                done.release()
            raise

    def _expand(self, ids: list[int], pads: list[int], media: list, fields: list[str] | None,
                text: str, sources: list[MediaSource]) -> ProcessedPrompt:
        out_ids: list[int] = []
        items: list[MMItem] = []
        prev = 0
        for n, (pos, (kind, src, uuid)) in enumerate(zip(pads, media)):
            try:
                item, source = self._load(kind, src, uuid)
            except MediaError as e:
                if fields and e.param is None:
                    e.param = fields[n]
                raise
            out_ids += ids[prev:pos]
            prev = pos + 1
            if kind == "video" and self.contract.video_timestamps:
                # Qwen3-VL: the one <|video_pad|> becomes, per temporal group,
                # "<t seconds><|vision_start|>" + its span + "<|vision_end|>"
                for prefix, sub, sub_source in self._timed_groups(item, source):
                    out_ids += prefix
                    sub.offset, sub.length = len(out_ids), self._length(sub.grid_thw)
                    items.append(sub)
                    sources.append(sub_source)
                    out_ids += [ids[pos]] * sub.length + [self.hf_config.vision_end_token_id]
                continue
            out_ids += self.wrappers[0]
            item.offset, item.length = len(out_ids), self._length(item.grid_thw)
            items.append(item)
            sources.append(source)
            out_ids += [ids[pos]] * item.length + self.wrappers[1]
        out_ids += ids[prev:]
        return self._finish(ProcessedPrompt(out_ids, items, text, sources))

    def _check_len(self, n: int, with_media: bool = False) -> None:
        # NOTE: `>=`: prompt + at least one output token must fit (engine/validate.py agrees).
        if self.max_model_len is not None and n >= self.max_model_len:
            hint = (" Images and videos count by their size: send smaller ones, or start the "
                    "server with a larger --max-model-len." if with_media else "")
            raise ValueError(context_message(self.max_model_len, n, None, "prompt") + hint)

    def _finish(self, p: ProcessedPrompt) -> ProcessedPrompt:
        if not p.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self._check_len(len(p.prompt_token_ids), bool(p.mm_items))
        if self.fill_pixels is not None:
            self.fill_pixels(p)
        return p


__all__ = ["InputProcessor", "MediaSource", "ProcessedPrompt"]
