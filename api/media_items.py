"""How one multimodal item of a prompt gets its key, its metadata and its pixels (P0).

``MediaItems`` is the media half of ``InputProcessor`` (api/processor.py): key an item
(``mmcache.hashing.media_key``), take its metadata from the processor cache on a hit, else
decode it and run the model's preprocessing (``mm_preprocessor``: the fast path or HF's);
and, for an item that left without pixels, produce them again from its ``MediaSource``
under the very settings its key was made with.
It reads the attributes ``InputProcessor.__init__`` sets (``media``, ``cache``, ``counts``,
``scope``, ``contract``, ``image_processor``, ``hf_config``, ``merge``, the video pixel
bounds) and its ``_hash_kwargs`` / ``for_request``.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from triptych.api.media.decode import (
    MediaError,
    MediaLimits,
    decode_image,
    decode_video,
    load_image,
    load_video,
    read_media_bytes,
)
from triptych.api.media.video import group_timestamps, preprocess_video, split_groups
from triptych.engine.request import MMItem
from triptych.mmcache.hashing import media_key
from triptych.models.image_ops import rgb_array
from triptych.mmcache.index import ItemMeta
from triptych.router.prompt import ProcessedPrompt

_MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses more; say so before it does


# What an item can be made from again: a URL not fetched yet, encoded bytes, an image's
# 8-bit RGB pixels [H, W, 3] (a PIL image given in Python, made RGB once), sampled frames
# with their rate, or nothing (a uuid the server held, sent without data).
Payload = str | bytes | np.ndarray | tuple[np.ndarray, float] | None


@dataclass
class MediaSource:
    """Where one item came from. Kept on P0 until the item is dispatched, so its pixels can
    be produced again (``InputProcessor.load_pixels``) when the processor cache skipped them
    and the worker chosen for the request turns out not to hold them."""

    modality: str  # "image" | "video"
    payload: Payload
    uuid: str | None = None  # the client's uuid, if it named the item
    # dtype/shape (and so nbytes) of the item's pixels, known even when they were skipped:
    # the processor cache plans by size and a ref's wire entry describes the tensor.
    meta: ItemMeta | None = None
    # NOTE: the media limits the item's key was made under (the request's lowered video
    # caps; no pixel budget): load_pixels must re-make exactly the pixels the key names,
    # not the server's defaults.
    media: MediaLimits | None = None
    # Qwen3-VL: this item is temporal group ``group`` of the video the payload makes
    # (api/media/video.py split_groups); ``whole`` holds that video's pixels once re-made,
    # shared by the groups' sources so load_pixels processes the clip once
    group: int | None = None
    whole: list[Any] | None = None
    whole_key: str | None = None  # that video's key (its groups' keys derive from it)
    # the pixels a preparation process left in shared memory (api/prep_pool.py
    # ``Prepared``): the item has pixel_values=None, its consumer reads them there
    prepared: Any = None

    def release(self) -> None:
        """Give back what it holds outside P0's memory (its shared-memory pixels)."""
        if self.prepared is not None:
            self.prepared.release()


@dataclass
class _Counts:
    queries: int = 0  # items looked up in the processor cache (every item)
    hits: int = 0  # of which the index held: no decode, no HF processor
    processed: int = 0  # items run through decode + HF processor
    lock: threading.Lock = field(default_factory=threading.Lock)  # prompts are processed
    # in a thread pool


def _same_pixels(expected: ItemMeta, got: ItemMeta, group: int | None) -> bool:
    """Whether re-made pixels (``got``: the whole item's) are what ``expected`` (the
    item's, or its temporal group's) describes."""
    if group is None:
        return (got.dtype, got.shape) == (expected.dtype, expected.shape)
    rows = got.grid_thw[1] * got.grid_thw[2]
    return (got.dtype, (rows, *got.shape[1:])) == (expected.dtype, expected.shape)


class MediaItems:
    """The media half of InputProcessor: keys, processor-cache lookups, preprocessing."""

    media: MediaLimits
    counts: _Counts
    prep: Any = None  # api/prep_pool.py PrepPool: encoded media are prepared there
    tenant: str | None = None  # whose turn a preparation takes (the pool is fair by tenant)
    # --mm-preprocessor: "fast" (models/image_ops.py, HF's values at a fraction of the
    # cost) or "hf" (HF's image processor); the contract picks the code, the key records it
    mm_preprocessor: str = "fast"

    # -- media ----------------------------------------------------------------------------
    def _load(self, kind: str, src: Any, uuid: str | None) -> tuple[MMItem, MediaSource]:
        """Key one item, then either take its metadata from the processor cache or decode +
        preprocess it; offset/length are filled in by _build."""
        kwargs = self._hash_kwargs(kind)
        if kind == "image":  # the two paths' pixels may differ in the last 8-bit level
            kwargs = {**kwargs, "preprocessor": self.mm_preprocessor}
        media = dataclasses.replace(self.media, budget=None)
        key = None
        if uuid is not None:
            # A uuid names the content: on a hit nothing is fetched or decoded (a URL is
            # kept unfetched for load_pixels).
            key = media_key(kind, kwargs, uuid=uuid, scope=self.scope)
            meta = self._lookup(key)
            if meta is not None:
                payload = src if src is None or isinstance(src, str) else self._payload(kind, src)
                return self._from_meta(key, meta), MediaSource(kind, payload, uuid, meta, media)
            if src is None:
                # NOTE: the same words whether nobody sent it or another tenant did (its key
                # differs): a uuid cannot be probed across tenants.
                raise ValueError(f"unknown {kind} uuid {uuid!r}: the server does not hold it; "
                                 f"send the {kind} with it")
        payload = self._payload(kind, src)
        if key is None:
            key = media_key(kind, kwargs, payload=payload)
            meta = self._lookup(key)
            if meta is not None:
                return self._from_meta(key, meta), MediaSource(kind, payload, None, meta, media)
        item, meta, prepared = self._process(kind, key, payload)
        if self.cache is not None:
            self.cache.put(key, meta)
        return item, MediaSource(kind, payload, uuid, meta, media, prepared=prepared)

    def _payload(self, kind: str, src: Any) -> Payload:
        """Encoded bytes of a URL/path, an image's RGB pixels, or sampled frames with their
        rate."""
        if isinstance(src, str):
            cap = self.media.max_image_bytes if kind == "image" else self.media.max_video_bytes
            return read_media_bytes(src, self.media, cap)
        if kind == "image":
            # PIL: checked, made 8-bit RGB, and copied out of Pillow once; the key hashes
            # that array in place and the fast path reads it
            return rgb_array(load_image(src, self.media))
        return load_video(src, self.media, pad=False)  # frame array: checked and sampled

    def _lookup(self, key: str) -> ItemMeta | None:
        meta = self.cache.lookup(key) if self.cache is not None else None
        with self.counts.lock:
            self.counts.queries += 1
            self.counts.hits += meta is not None
        return meta

    def _from_meta(self, key: str, meta: ItemMeta) -> MMItem:
        return MMItem(meta.modality, key, 0, 0, meta.grid_thw, None, meta.second_per_grid_t)

    def _length(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge ** 2

    def _process(self, kind: str, key: str, payload: Payload
                 ) -> tuple[MMItem, ItemMeta, Any]:
        """Decode (if still encoded) + preprocessing, the expensive part a hit skips: here,
        or for encoded media in a preparation process when the server has them (then the
        item has no pixel_values and the third value, a ``Prepared``, says where they are)."""
        with self.counts.lock:
            self.counts.processed += 1
        if self.prep is not None and isinstance(payload, bytes):
            return self._prepare_elsewhere(kind, key, payload)
        item, frames = self._process_here(kind, key, payload)
        meta = ItemMeta.of(kind, item.grid_thw, self._length(item.grid_thw), item.pixel_values,
                           item.second_per_grid_t, frames)
        return item, meta, None

    def _prepare_elsewhere(self, kind: str, key: str, payload: bytes
                           ) -> tuple[MMItem, ItemMeta, Any]:
        from triptych.api.prep_wire import Job

        budget = self.media.budget
        caps = self.media.caps()
        if budget is not None:  # the rest of the request's pixel budget caps this item
            caps["max_request_pixels"] = budget.limit - budget.used
        groups = kind == "video" and bool(self.contract.video_timestamps)
        done, prepared = self.prep.run(Job(kind, key, payload, caps, groups), self.tenant)
        try:
            self.media.charge(done.pixels_charged)
            grid = (done.grid[0], done.grid[1], done.grid[2])
            meta = ItemMeta(kind, grid, self._length(grid), done.dtype, tuple(done.shape),
                            done.second_per_grid_t, done.num_frames)
        except BaseException:
            prepared.release()
            raise
        return MMItem(kind, key, 0, 0, grid, None, done.second_per_grid_t), meta, prepared

    def _process_here(self, kind: str, key: str, payload: Payload
                      ) -> tuple[MMItem, int | None]:
        """Decode + preprocess in this process; also the video's sampled frame count
        (before padding; None for an image)."""
        ip = self.image_processor
        if kind == "image":
            img = decode_image(payload, self.media) if isinstance(payload, bytes) else payload
            h, w = img.shape[:2] if isinstance(img, np.ndarray) else (img.height, img.width)
            if max(w, h) > _MAX_ASPECT_RATIO * min(w, h):
                raise MediaError(f"image is {w}x{h}: aspect ratio above {_MAX_ASPECT_RATIO}")
            pixels, grid = self.contract.preprocess_image(ip, img, self.hf_config,
                                                          self.mm_preprocessor)
            return MMItem("image", key, 0, 0, grid, pixels), None
        frames, fps = decode_video(payload, self.media, pad=False) if isinstance(payload, bytes) \
            else payload
        h, w = frames.shape[1:3]
        if max(w, h) > _MAX_ASPECT_RATIO * min(w, h):
            raise MediaError(f"video is {w}x{h}: aspect ratio above {_MAX_ASPECT_RATIO}")
        pv, grid = preprocess_video(frames, ip, min_pixels=self.video_min_pixels,
                                    max_pixels=self.video_max_pixels,
                                    per_video=self.contract.video_timestamps,
                                    frame_cap_tokens=self.video_frame_cap_tokens)
        return MMItem("video", key, 0, 0, grid, torch.from_numpy(pv),
                      ip.temporal_patch_size / fps), len(frames)

    # -- processor cache ------------------------------------------------------------------
    def load_pixels(self, item: MMItem, source: MediaSource) -> torch.Tensor | None:
        """Give an item that left without pixels (a processor-cache hit) its pixels again:
        the router calls this when the worker it picked does not hold the item.

        ValueError (a 400) when that is impossible: a uuid sent without data that no longer
        has pixels anywhere, or a uuid whose data now differs from what it named before.
        Blocking (it may fetch a URL and runs the HF processor): call it in a worker thread,
        never under the lock that sends.
        """
        if item.pixel_values is not None or source.prepared is not None:
            return item.pixel_values
        payload = source.payload
        if payload is None:
            raise ValueError(f"the {item.modality} with uuid {source.uuid!r} is no longer "
                             f"cached; send the {item.modality} with it again")
        # The settings the key was made under (the request's frame caps), not this
        # processor's defaults: other caps give another patch grid.
        view = self if source.media is None else self.for_request(source.media)
        if isinstance(payload, str):
            payload = view._payload(item.modality, payload)
            source.payload = payload  # fetch once
        if source.group is None:
            fresh, meta, prepared = view._process(item.modality, item.mm_hash, payload)
        else:  # one temporal group of a video: process the clip once for all its groups
            if source.whole is None or not source.whole:
                whole = view._process(item.modality, source.whole_key or item.mm_hash,
                                      payload)
                if source.whole is not None:
                    source.whole.append(whole)
            else:
                whole = source.whole[0]
            fresh, meta, prepared = split_groups(whole[0])[source.group], whole[1], whole[2]
        if fresh.grid_thw != item.grid_thw or \
                fresh.second_per_grid_t != item.second_per_grid_t or \
                (source.meta is not None and not _same_pixels(source.meta, meta, source.group)):
            if prepared is not None:
                prepared.release()
            if self.cache is not None:
                self.cache.discard(item.mm_hash)
            if source.uuid is None:  # a content key always gives the same result
                raise RuntimeError(f"{item.modality} {item.mm_hash[:12]} processed differently "
                                   "the second time")
            raise ValueError(f"the {item.modality} with uuid {source.uuid!r} differs from the "
                             "one sent before under that uuid")
        if prepared is not None:  # its pixels are in shared memory, for the worker to read
            source.prepared = prepared
            return None
        item.pixel_values = fresh.pixel_values
        return item.pixel_values

    def _timed_groups(self, item: MMItem, source: MediaSource
                      ) -> list[tuple[list[int], MMItem, MediaSource]]:
        """A Qwen3-VL video as Qwen3VLProcessor lays it out: per temporal group, the ids of
        ``<{seconds:.1f} seconds><|vision_start|>`` before its span (the caller closes each
        with ``<|vision_end|>``), the group's item and a source that can re-make its pixels."""
        cfg, tps = self.hf_config, self.image_processor.temporal_patch_size
        stamps = group_timestamps(item.grid_thw[0], tps, item.second_per_grid_t,
                                  source.meta.num_frames if source.meta else None)
        whole: list[Any] = []
        out = []
        for g, sub in enumerate(split_groups(item)):
            meta = source.meta
            if meta is not None:
                rows = sub.grid_thw[1] * sub.grid_thw[2]
                meta = dataclasses.replace(meta, grid_thw=sub.grid_thw,
                                           length=self._length(sub.grid_thw),
                                           shape=(rows, *meta.shape[1:]))
            src = dataclasses.replace(source, meta=meta, group=g, whole=whole,
                                      whole_key=item.mm_hash)
            prefix = self.tokenizer.encode(f"<{stamps[g]:.1f} seconds>", add_special_tokens=False)
            out.append((prefix + [cfg.vision_start_token_id], sub, src))
        return out

    def ensure_pixels(self, prompt: ProcessedPrompt) -> None:
        """``load_pixels`` for every item of ``prompt`` that has none."""
        for item, source in zip(prompt.mm_items, prompt.mm_sources):
            self.load_pixels(item, source)

    def stats(self) -> dict[str, float]:
        """Processor-cache counters of this P0 (the bytes are nominal: pixels the index
        describes; the tensors themselves live in the workers or the shm ring)."""
        cache = self.cache
        return {"mm_processor_cache_queries": float(self.counts.queries),
                "mm_processor_cache_hits": float(self.counts.hits),
                "mm_processor_cache_index_bytes": float(cache.num_bytes if cache else 0),
                "mm_processor_cache_index_entries": float(len(cache) if cache else 0),
                "mm_items_processed": float(self.counts.processed)}
