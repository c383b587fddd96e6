"""EncoderRunner: processed mm items in, vision embeddings keyed by mm hash out.

This is the boundary the encode pool sits behind: it sees pixel values and patch grids,
never requests or prompts.
"""
from __future__ import annotations

from typing import Callable

import torch

from triptych.encode.encoder_cache import EncoderCache
from triptych.engine.request import MMItem

# (pixel_values [P, patch_dim], grid_thw [N, 3]) -> one [rows_i, hidden] tensor per item
EncodeFn = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]


class EncoderRunner:
    def __init__(self, encode_fn: EncodeFn, cache: EncoderCache, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.encode_fn = encode_fn
        self.cache = cache
        self.device, self.dtype = device, dtype
        self.num_items_encoded = 0

    @torch.inference_mode()
    def get_embeddings(self, items: list[MMItem]) -> dict[str, torch.Tensor]:
        """Embeddings of ``items`` (deduplicated by hash), running the tower on misses only."""
        out: dict[str, torch.Tensor] = {}
        missing: dict[str, MMItem] = {}
        for it in items:
            if it.mm_hash in out or it.mm_hash in missing:
                continue
            if it.embedding is not None:  # encoded elsewhere (the encode pool)
                out[it.mm_hash] = it.embedding
                continue
            self.cache.num_queries += 1
            emb = self.cache.get(it.mm_hash)
            if emb is None:
                if it.pixel_values is None:
                    raise ValueError(f"{it.modality} {it.mm_hash[:12]} is neither cached nor attached")
                missing[it.mm_hash] = it
            else:
                self.cache.num_hits += 1
                out[it.mm_hash] = emb
        if missing:
            todo = list(missing.values())
            pixels = torch.cat([it.pixel_values for it in todo]).to(self.device, self.dtype)
            grid = torch.tensor([it.grid_thw for it in todo], dtype=torch.long, device=self.device)
            embs = self.encode_fn(pixels, grid)
            pinned = set(out) | set(missing)
            for it, emb in zip(todo, embs):
                if emb.shape[0] != it.length:
                    raise ValueError(f"{it.modality} gave {emb.shape[0]} embedding rows for "
                                     f"{it.length} placeholder tokens")
                self.cache.put(it.mm_hash, emb, pinned)
                out[it.mm_hash] = emb
            self.num_items_encoded += len(todo)
        return out
