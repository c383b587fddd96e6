"""Qwen2-VL and Qwen2.5-VL under the model contract (models/contract.py).

M-RoPE over (t, h, w) with contiguous sections, one embedding per placeholder row (the
payload is the embedding alone), the head size derived from hidden_size as HF's attention
does, the TP plan of models/tp_plan.py.
"""
from __future__ import annotations

from typing import Any

from triptych.models.contract import ModelContract


class Qwen2VLContract(ModelContract):
    architectures = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    model_types = ("qwen2_vl", "qwen2_5_vl")

    def head_dim(self, text: Any) -> int:
        # NOTE: HF's Qwen2-VL attention ignores a stated head_dim; see text_head_dim.
        from triptych.models.qwen2_vl import text_head_dim

        return text_head_dim(text)

    def model_class(self) -> type:
        from triptych.models.qwen2_vl import Qwen2VLForCausalLM

        return Qwen2VLForCausalLM

    def make_tiny(self, arch: str, out_dir: str, **kw: Any) -> str:
        from triptych.models.tiny import make_tiny_qwen2_vl

        return make_tiny_qwen2_vl(arch, out_dir, **kw)
