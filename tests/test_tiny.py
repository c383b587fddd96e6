"""make-tiny: real HF-format checkpoints that HF's Auto classes load offline."""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from triptych.models import tiny


def img(seed: int, w: int = 56, h: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def ckpt(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}")


def test_files_and_config(ckpt):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.json", "preprocessor_config.json",
                 "video_preprocessor_config.json", "generation_config.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    # The config's special ids are OUR tokenizer's.
    for attr, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"),
                        ("vision_end_token_id", "<|vision_end|>")]:
        assert getattr(cfg, attr) == tok.convert_tokens_to_ids(token), attr
    text = cfg.text_config
    assert text.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert text.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert 300 < len(tok) <= text.vocab_size  # trained BPE + specials; embedding may be padded
    v = cfg.vision_config
    assert (v.patch_size, v.spatial_merge_size, v.temporal_patch_size) == (14, 2, 2)
    if cfg.model_type == "qwen2_5_vl":
        assert v.window_size == 112 and v.fullatt_block_indexes == [1]
        assert v.out_hidden_size == text.hidden_size
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"


def test_auto_classes_load_offline(ckpt, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import (AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor,
                              AutoTokenizer)

    model = AutoModelForImageTextToText.from_pretrained(ckpt)
    assert type(model).__name__ in ("Qwen2VLForConditionalGeneration",
                                    "Qwen2_5_VLForConditionalGeneration")
    ip = AutoImageProcessor.from_pretrained(ckpt, backend="pil")
    assert type(ip).__name__ == "Qwen2VLImageProcessorPil"
    out = ip(images=[img(0, 224, 224)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 16, 16]]  # 224x224 keeps its size
    assert AutoTokenizer.from_pretrained(ckpt).chat_template
    # The snag documented in models/tiny.py: no torchvision, no AutoProcessor (so triptych
    # needs neither); with a working torchvision it loads.
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - PyPI's build fails to import beside the CPU torch
        with pytest.raises((ValueError, ImportError, AttributeError),
                           match=r"(?i)torchvision|video"):
            AutoProcessor.from_pretrained(ckpt)
    else:
        assert AutoProcessor.from_pretrained(ckpt) is not None


def test_chat_template_renders_qwen2_vl_chatml(tiny_qwen2_vl):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_vl, local_files_only=True)
    msgs = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}, {"type": "image"},
        {"type": "video_url", "video_url": {"url": "y"}}, {"type": "video"},
        {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "Nothing."}, {"role": "user", "content": "Sure?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    img_ph, vid_ph = ("<|vision_start|><|image_pad|><|vision_end|>",
                      "<|vision_start|><|video_pad|><|vision_end|>")
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    f"<|im_start|>user\n{img_ph}{img_ph}{vid_ph}{vid_ph}What?<|im_end|>\n"
                    "<|im_start|>assistant\nNothing.<|im_end|>\n"
                    "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    sys_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(sys_msgs, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    for t in tiny.SPECIAL_TOKENS:  # each special is one token, never split by BPE
        assert len(tok.encode(t, add_special_tokens=False)) == 1


def test_different_images_give_different_logits(tiny_qwen2_vl):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    ip = AutoImageProcessor.from_pretrained(tiny_qwen2_vl, backend="pil")
    text = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Describe."
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    types = (ids == model.config.image_token_id).long()  # 1 marks image tokens (M-RoPE)
    last = []
    for seed in (1, 2):
        pix = ip(images=[img(seed)], return_tensors="pt")
        with torch.no_grad():
            out = model(input_ids=ids, pixel_values=pix["pixel_values"],
                        image_grid_thw=pix["image_grid_thw"], mm_token_type_ids=types)
        last.append(out.logits[0, -1])
    # init_std 0.15: the image really moves the next-token distribution.
    assert (last[0] - last[1]).abs().max() > 1e-2


def test_tokenizer_is_deterministic():
    a, b = tiny._train_tokenizer(1024), tiny._train_tokenizer(1024)
    assert a.get_vocab() == b.get_vocab() and len(a) <= 1024


def test_cli_flags_all_have_help():
    parser = argparse.ArgumentParser()
    tiny.add_parser(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["make-tiny"]
    flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert {"arch", "out", "seed", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
            "vision_depth", "vision_embed_dim", "vocab_size"} <= {a.dest for a in flags}
    assert all(a.help for a in flags)
    args = parser.parse_args(["make-tiny", "--arch", "qwen2_5_vl", "--out", "d", "--seed", "3"])
    assert (args.arch, args.out, args.seed, args.hidden_size) == ("qwen2_5_vl", "d", 3, 64)


def test_bad_arch_and_shapes_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        tiny.make_tiny("llama", str(tmp_path))
    with pytest.raises(ValueError, match="multiple"):
        tiny.make_tiny("qwen2_vl", str(tmp_path), hidden_size=60, num_heads=4)
