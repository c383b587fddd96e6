"""InternVL in HF format (InternVL3 / 3.5 "-HF") for the paged engine.

    pixels   tiles of one image (dynamic crops + a thumbnail, GotOcr2ImageProcessor), each
             S x S, travel as flat patches [tiles * g * g, 3 * p * p] with grid (tiles, g, g)
             (g = S / p), the same layout the engine checks for every model
    tower    HF's InternViT (InternVLVisionModel), last layer, CLS dropped
    shuffle  pixel shuffle by downsample_ratio r: g x g features -> (g*r) x (g*r), channels
             / r**2; so "spatial merge" = 1 / r and an image holds tiles * (g*r)**2 rows
    project  LayerNorm -> Linear -> GELU -> Linear (multi_modal_projector)
    decoder  Qwen2 (InternVL3) or Qwen3 (InternVL3.5: q/k norm, the config's head_dim)
             with 1-D RoPE: the contract gives the same position on all three M-RoPE rows,
             and any split of identical rows over the frequencies is plain RoPE

Parameter names: visual.vision_tower.* / visual.multi_modal_projector.* (checkpoint
model.vision_tower.* / model.multi_modal_projector.*), language_model.*, lm_head.*.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from triptych.kernels import get_ops
from triptych.models.meta_build import on_meta
from triptych.models.vision import host_grid
from triptych.models.qwen2_vl import Qwen2TextModel, Qwen2VLForCausalLM, text_head_dim
from triptych.models.qwen3_vl import Qwen3TextModel, interleaved_rope_plan
from triptych.models.weight_parts import check_parts


def patchify(tiles: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, 3, S, S] -> [N * g * g, 3 * p * p] (row-major patches per tile)."""
    n, c, s, _ = tiles.shape
    g = s // patch
    x = tiles.reshape(n, c, g, patch, g, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n * g * g, c * patch * patch)


def unpatchify(flat: torch.Tensor, tiles: int, g: int, patch: int) -> torch.Tensor:
    """Inverse of ``patchify``: [N * g * g, 3 * p * p] -> [N, 3, g * p, g * p]."""
    x = flat.reshape(tiles, g, g, -1, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(tiles, -1, g * patch, g * patch)


def pixel_shuffle(x: torch.Tensor, r: float) -> torch.Tensor:
    """[N, g, g, C] -> [N, g*r, g*r, C / r**2], HF's InternVL order (width-major reshape,
    then the swap back)."""
    n, w, h, c = x.shape
    x = x.view(n, w, int(h * r), int(c / r)).permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * r), int(w * r), int(c / (r * r)))
    return x.permute(0, 2, 1, 3).contiguous()


class InternVLVision(nn.Module):
    """InternViT + pixel shuffle + projector: tiles -> [tiles * (g*r)**2, hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.internvl.modeling_internvl import (
            InternVLMultiModalProjector,
            InternVLVisionModel,
        )

        self.config = config
        self.vision_tower = InternVLVisionModel(config.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(config)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values=tiles, return_dict=True)
        feats = out.last_hidden_state
        if self.config.vision_feature_select_strategy == "default":
            feats = feats[:, 1:, :]  # the CLS token
        n, length, c = feats.shape
        g = int(length ** 0.5)
        feats = pixel_shuffle(feats.reshape(n, g, g, c), self.config.downsample_ratio)
        return self.multi_modal_projector(feats.reshape(n, -1, feats.shape[-1]))


class InternVLForCausalLM(Qwen2VLForCausalLM):
    """InternVL (Qwen2 or Qwen3 decoder) on flat token batches. With ``tp`` the language
    model is sharded (models/tp_plan.py, the Qwen plan); the tower stays whole."""

    supports_encoder_data_parallel = True  # tiles never attend across items

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 attention_backend: str = "torch", tp: Any = None, shard_vision: bool = True,
                 parts: str = "all") -> None:
        nn.Module.__init__(self)
        self.parts = check_parts(parts)
        text = config.text_config
        self.config = config
        self.ops = get_ops(attention_backend)
        rp = dict(getattr(text, "rope_parameters", None) or {})
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rp.get('rope_type')!r} is not supported")
        self.rope_theta = float(rp.get("rope_theta", getattr(text, "rope_theta", 1e6)))
        self.qwen3 = text.model_type == "qwen3"
        self.head_dim = int(text.head_dim) if self.qwen3 else text_head_dim(text)
        self.mrope_section = [self.head_dim // 2, 0, 0]  # 1-D: every frequency reads row 0
        # NOTE: HF ties by the top-level flag (the text config's is not read)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.pack_head = ""
        self._head_gemm: Any = None
        v = config.vision_config
        self.patch = v.patch_size[0] if isinstance(v.patch_size, (list, tuple)) else v.patch_size
        with on_meta():
            if parts != "language":
                self.visual = InternVLVision(config)
            if parts != "vision":
                self.language_model = Qwen3TextModel(text, self.head_dim, self.ops) \
                    if self.qwen3 else Qwen2TextModel(text, self.ops)
                if not self.tie_word_embeddings:
                    self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if tp is not None and tp.size > 1:
            from triptych.models.tp_plan import shard_qwen2_vl

            shard_qwen2_vl(self, tp, shard_vision=False)
        self.to(dtype=dtype)
        self.to_empty(device=device)
        self.register_buffer("cos_sin_cache", self._rope_cache(text.max_position_embeddings,
                                                               device), persistent=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if not self.qwen3:
            return super().forward(input_ids, positions, inputs_embeds)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        axis = torch.zeros(self.head_dim // 2, dtype=torch.long, device=positions.device)
        rope = interleaved_rope_plan(positions, self.cos_sin_cache, axis)  # every freq: row 0
        return self.language_model(x, rope, None)

    @property
    def spatial_merge_size(self) -> int:
        return round(1 / self.config.downsample_ratio)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                      ) -> list[torch.Tensor]:
        """Payloads, one [tiles * (g*r)**2, hidden] tensor per image (its tiles in order)."""
        if self.parts == "language":
            raise ValueError("this worker loaded the language model only (no vision tower): "
                             "its images must come encoded from the encode pool")
        grid = host_grid(grid_thw)  # (the engine's grid is a host array already)
        tiles = grid[:, 0].tolist()
        g = int(grid[0, 1])
        emb = self.visual(unpatchify(pixel_values, sum(tiles), g, self.patch))
        per_tile = emb.shape[1]
        return [e.reshape(n * per_tile, -1) for e, n in zip(emb.split(tiles), tiles)]
