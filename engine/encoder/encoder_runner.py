"""EncoderRunner: processed mm items in, vision embeddings keyed by mm hash out.

This is the boundary the encode pool sits behind: it sees pixel values and patch grids,
never requests or prompts.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from triptych.engine.device.device_io import to_device
from triptych.engine.encoder.encoder_cache import EncoderCache
from triptych.engine.request import MMItem

# (pixel_values [P, patch_dim] on the device, grid_thw [N, 3] on the HOST) -> one
# [rows_i, hidden] tensor per item. NOTE: the grid stays on the host: the tower derives its
# indices and sizes there and never reads the device back.
EncodeFn = Callable[[torch.Tensor, np.ndarray], list[torch.Tensor]]


class EncoderRunner:
    def __init__(self, encode_fn: EncodeFn, cache: EncoderCache, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.encode_fn = encode_fn
        self.cache = cache
        self.device, self.dtype = device, dtype
        self.num_items_encoded = 0

    @torch.inference_mode()
    def get_embeddings(self, items: list[MMItem]) -> dict[str, torch.Tensor]:
        """Embeddings of ``items`` (deduplicated by hash), running the tower on misses only.

        The hits stay pinned while the misses are inserted, so one call never evicts what it
        is about to return; callers that need entries across steps pin them themselves
        (``cache.acquire`` / ``cache.release``).
        """
        out: dict[str, torch.Tensor] = {}
        missing: dict[str, MMItem] = {}
        for it in items:
            if it.mm_hash in out or it.mm_hash in missing:
                continue
            if it.embedding is not None:  # encoded elsewhere (the encode pool)
                out[it.mm_hash] = it.embedding
                continue
            emb = self.cache.lookup(it.mm_hash)
            if emb is None:
                if it.pixel_values is None:
                    raise ValueError(f"{it.modality} {it.mm_hash[:12]} is neither cached nor attached")
                missing[it.mm_hash] = it
            else:
                out[it.mm_hash] = emb
        if not missing:
            return out
        hits = [h for h in out if h in self.cache]
        self.cache.acquire(hits)
        try:
            todo = list(missing.values())
            pixels = to_device(torch.cat([it.pixel_values for it in todo]),
                               self.device).to(self.dtype)
            grid = np.array([it.grid_thw for it in todo], dtype=np.int64)
            embs = self.encode_fn(pixels, grid)
            for it, emb in zip(todo, embs):
                if emb.shape[0] != it.length:
                    raise ValueError(f"{it.modality} gave {emb.shape[0]} embedding rows for "
                                     f"{it.length} placeholder tokens")
                self.cache.put(it.mm_hash, emb)
                out[it.mm_hash] = emb
            self.num_items_encoded += len(todo)
        finally:
            self.cache.release(hits)
        return out
