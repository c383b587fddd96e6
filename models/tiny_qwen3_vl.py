"""A tiny random HF-format Qwen3-VL (or -MoE) checkpoint (``make-tiny --arch qwen3_vl[_moe]``).

HF's own Qwen3VLForConditionalGeneration with random weights under a seed, the same
locally trained tokenizer as the Qwen2-VL tiny checkpoints (Qwen3-VL uses the same vision
tokens) with the real Qwen3-VL Instruct chat template (models/qwen3_vl_template.py: tools,
tool results with images), and HF's Qwen2-VL image processor configured as Qwen3-VL's
real one (patch 16, merge 2, mean/std 0.5). The head_dim deliberately differs from
hidden / heads, and two of three vision blocks feed DeepStack, so both paths are tested.
"""
from __future__ import annotations

import json
import os
from typing import Any


def make_tiny_qwen3_vl(out_dir: str, *, seed: int = 0, hidden_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       head_dim: int | None = None, intermediate_size: int | None = None,
                       vision_depth: int = 3, vision_embed_dim: int = 32, vision_heads: int = 2,
                       vocab_size: int = 1024, model_vocab_size: int | None = None,
                       init_std: float | None = None, max_position_embeddings: int = 8192,
                       moe: bool = False, num_experts: int = 4, num_experts_per_tok: int = 2,
                       **_ignored: Any) -> str:
    """Write the checkpoint to ``out_dir``; returns it. ``head_dim`` defaults to twice
    hidden / heads (Qwen3 states its own); DeepStack taps every vision block but the last.
    ``moe``: Qwen3-VL-MoE, every layer but the last sparse (so both MLP kinds are tested)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from triptych.models.tiny import (
        SPECIAL_TOKENS,
        _train_tokenizer,
        edit_json,
        save_tokenizer_files,
    )

    head_dim = head_dim or 2 * (hidden_size // num_heads)
    half = head_dim // 2
    if head_dim % 4 or num_heads % num_kv_heads or vision_depth < 2:
        raise ValueError("head_dim must be a multiple of 4, num_heads a multiple of "
                         "num_kv_heads, vision_depth >= 2")
    os.makedirs(out_dir, exist_ok=True)
    from triptych.models.qwen3_vl_template import QWEN3_VL_TEMPLATE

    tok = _train_tokenizer(vocab_size, template=QWEN3_VL_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    std = init_std if init_std is not None else (0.15 if hidden_size <= 256 else 0.02)
    hw = half * 5 // 16  # Qwen3-VL's [24, 20, 20] of 64, scaled
    text = dict(vocab_size=max(model_vocab_size or 0, len(tok)), hidden_size=hidden_size,
                num_hidden_layers=num_layers, head_dim=head_dim,
                intermediate_size=intermediate_size or hidden_size * 3,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [half - 2 * hw, hw, hw],
                                 "mrope_interleaved": True,
                                 "rope_theta": 10000.0 if hidden_size > 256 else 100.0},
                initializer_range=std, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=True)
    if moe:
        text.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                    moe_intermediate_size=hidden_size // 2 + 8, decoder_sparse_step=1,
                    mlp_only_layers=[num_layers - 1] if num_layers > 1 else [])
    vision = dict(depth=vision_depth, hidden_size=vision_embed_dim, num_heads=vision_heads,
                  intermediate_size=vision_embed_dim * 2, out_hidden_size=hidden_size,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=64,
                  deepstack_visual_indexes=list(range(vision_depth - 1)), initializer_range=std)
    cfg_cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else \
        transformers.Qwen3VLForConditionalGeneration
    cfg = cfg_cls(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    cfg.architectures = [cls.__name__]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer_files(tok, out_dir)
    # Qwen3-VL's processor: 32-pixel merge cells (patch 16 x merge 2), mean/std 0.5; the
    # pixel budget in "size" as the hub writes it (its 64 to 16384 cells scaled to 4 to 256)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             min_pixels=64 * 64, max_pixels=256 * 32 * 32,
                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
                             ).save_pretrained(out_dir)
    edit_json(os.path.join(out_dir, "preprocessor_config.json"),
              image_processor_type="Qwen2VLImageProcessorFast", processor_class="Qwen3VLProcessor")
    # Qwen3-VL's video processor settings (one pixel budget per clip, frames x h x w), small
    with open(os.path.join(out_dir, "video_preprocessor_config.json"), "w") as f:
        json.dump({"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                   "temporal_patch_size": 2, "merge_size": 2, "fps": 2,
                   "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32},
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, f, indent=2)
    return out_dir
