"""A tiny random HF-format InternVL checkpoint (``make-tiny --arch internvl``).

HF's own InternVLForConditionalGeneration with random weights under a seed: a 2-layer
InternViT (56-pixel tiles of 14-pixel patches: 4 x 4 patches, 2 x 2 rows after the pixel
shuffle, so 4 placeholder rows per tile), the MLP projector, a tiny Qwen2 decoder; the
shared locally trained BPE with InternVL's special tokens and a ChatML template that,
like the real InternVL-HF templates, knows only ``{"type": "image"}`` parts (it writes one
``<IMG_CONTEXT>`` per image; the processor expands it).

The processor files are written as the hub's InternVL-HF checkpoints write them, so HF's
own ``InternVLProcessor`` loads them (the oracle of tests/test_internvl.py): GotOcr2's
image processor with ImageNet mean/std, ``min_patches`` 1 / ``max_patches`` 12 and
``"crop_to_patches": false`` (HF's InternVLProcessor turns the crop on for every call; the
stored false is what a reader of the file alone gets wrong), ``processor_config.json``
with the tile's ``image_seq_length``, and the tokenizer naming its image tokens
(``start_image_token``, ``end_image_token``, ``context_image_token``, ``video_token``).
"""
from __future__ import annotations

import json
import os
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>",
            "<IMG_CONTEXT>", "<video>"]
# the names the hub's tokenizer_config.json gives them (HF's InternVLProcessor reads these)
NAMED = {"start_image_token": "<img>", "end_image_token": "</img>",
         "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}

# NOTE: only {"type": "image"} makes an image here (as in the real checkpoints' templates):
# an image_url part reaching it unconverted would vanish from the prompt.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


PROCESSOR = "InternVLProcessor"


def make_tiny_internvl(out_dir: str, *, seed: int = 0, hidden_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       vision_layers: int = 2, vision_hidden: int = 32, vision_heads: int = 2,
                       tile: int = 56, max_patches: int = 12, vocab_size: int = 1024,
                       model_vocab_size: int | None = None, init_std: float | None = None,
                       max_position_embeddings: int = 8192, text_arch: str = "qwen2",
                       **_ignored: Any) -> str:
    """Write the checkpoint to ``out_dir``; returns it. ``text_arch="qwen3"``: InternVL3.5's
    decoder (q/k norm; head_dim twice hidden / heads, so the config's value is the one used)."""
    import torch
    import transformers
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )
    from triptych.models.tiny import _train_tokenizer, edit_json, save_tokenizer_files

    os.makedirs(out_dir, exist_ok=True)
    tok = _train_tokenizer(vocab_size, SPECIALS, TEMPLATE, NAMED)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    # the model's vocab is padded to a multiple of 64 (as real checkpoints pad theirs), so
    # tensor_parallel_size 2 / 4 divides it
    std = init_std if init_std is not None else 0.15
    vocab = max(model_vocab_size or 0, -(-len(tok) // 64) * 64)
    text = dict(model_type=text_arch, vocab_size=vocab,
                hidden_size=hidden_size, num_hidden_layers=num_layers,
                intermediate_size=hidden_size * 3, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                initializer_range=std, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=False)
    if text_arch == "qwen3":
        text["head_dim"] = 2 * hidden_size // num_heads
    vision = dict(hidden_size=vision_hidden, num_hidden_layers=vision_layers,
                  num_attention_heads=vision_heads, intermediate_size=vision_hidden * 2,
                  image_size=[tile, tile], patch_size=[14, 14], initializer_range=std)
    cfg = transformers.InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
        downsample_ratio=0.5, image_seq_length=(tile // 14) ** 2 // 4,
        projector_hidden_act="gelu", vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False)
    cfg.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "lambda" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer_files(tok, out_dir)
    # as the hub writes it: the "Fast" class name, crop_to_patches false (see the docstring)
    GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=False,
                             min_patches=1, max_patches=max_patches,
                             image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
                             ).save_pretrained(out_dir)
    edit_json(os.path.join(out_dir, "preprocessor_config.json"),
              image_processor_type="GotOcr2ImageProcessorFast", processor_class=PROCESSOR)
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"image_seq_length": cfg.image_seq_length, "processor_class": PROCESSOR},
                  f, indent=2)
    return out_dir
