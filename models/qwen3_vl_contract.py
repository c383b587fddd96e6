"""Qwen3-VL (dense) under the model contract (models/contract.py).

The payload of an item is ``[rows, hidden * (1 + k)]``: the merger's embedding, then the
k DeepStack features (one per ``deepstack_visual_indexes`` entry). head_dim is the
config's own. Videos as HF's Qwen3VLProcessor lays them out (``video_timestamps``): per
temporal group, "<t seconds><|vision_start|>" + its span + "<|vision_end|>"; the processor
sends each group as a video item of grid (1, h, w), which is also how HF's get_rope_index
splits video grids, so positions and the tower (DeepStack included) treat it like an image.
"""
from __future__ import annotations

from typing import Any

from triptych.models.contract import ModelContract


class Qwen3VLContract(ModelContract):
    architectures = ("Qwen3VLForConditionalGeneration",)
    model_types = ("qwen3_vl",)
    modalities = ("image", "video")
    video_timestamps = True

    def head_dim(self, text: Any) -> int:
        # Qwen3 states head_dim and its attention uses it (it may differ from hidden/heads)
        return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)

    def payload_width(self, hf: Any) -> int:
        k = len(hf.vision_config.deepstack_visual_indexes)
        return self.text_config(hf).hidden_size * (1 + k)

    def check(self, hf: Any) -> None:
        v = hf.vision_config
        idx = list(getattr(v, "deepstack_visual_indexes", None) or [])
        if not idx:
            raise ValueError("a Qwen3-VL config needs vision_config.deepstack_visual_indexes "
                             "(the DeepStack layers); this one has none")
        if max(idx) >= v.depth or min(idx) < 0:
            raise ValueError(f"deepstack_visual_indexes {idx} must name vision blocks "
                             f"0..{v.depth - 1}")
        if v.out_hidden_size != self.text_config(hf).hidden_size:
            raise ValueError(f"vision out_hidden_size {v.out_hidden_size} differs from the "
                             f"language model's hidden_size {self.text_config(hf).hidden_size}")

    def model_class(self) -> type:
        from triptych.models.qwen3_vl import Qwen3VLForCausalLM

        return Qwen3VLForCausalLM

    def make_tiny(self, arch: str, out_dir: str, **kw: Any) -> str:
        from triptych.models.tiny_qwen3_vl import make_tiny_qwen3_vl

        return make_tiny_qwen3_vl(out_dir, **kw)


class Qwen3VLMoeContract(Qwen3VLContract):
    """Qwen3-VL-MoE: the same tower, positions and payload; the decoder's MLPs are
    mixtures of experts (models/fused_moe.py), chosen per layer by the config."""

    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    model_types = ("qwen3_vl_moe",)

    def check(self, hf: Any) -> None:
        super().check(hf)
        text = self.text_config(hf)
        if not getattr(text, "num_experts", 0) or text.num_experts_per_tok > text.num_experts:
            raise ValueError(f"a Qwen3-VL-MoE config needs num_experts >= num_experts_per_tok "
                             f"> 0, got {getattr(text, 'num_experts', None)} and "
                             f"{getattr(text, 'num_experts_per_tok', None)}")

    def make_tiny(self, arch: str, out_dir: str, **kw: Any) -> str:
        from triptych.models.tiny_qwen3_vl import make_tiny_qwen3_vl

        return make_tiny_qwen3_vl(out_dir, moe=True, **kw)
