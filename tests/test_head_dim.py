"""One head size for the attention, its rotary tables and the KV cache (models.text_head_dim).

HF's Qwen2-VL attention sizes heads as hidden_size / num_attention_heads and ignores a
``head_dim`` in the config (its rotary embedding would read one). A checkpoint that states
the derived value loads with one consistent shape and matches HF; one whose ``head_dim``
differs cannot run in HF either and is refused before any weight loads (it used to get a
KV cache of one size and attention of another)."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_greedy, load_hf_model

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402


def _with_head_dim(src: str, dst: str, head_dim: int) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["text_config"]["head_dim"] = head_dim
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_stated_head_dim_gives_one_shape_and_hf_tokens(tiny_qwen2_vl, tmp_path):
    with open(os.path.join(tiny_qwen2_vl, "config.json")) as f:
        text = json.load(f)["text_config"]
    derived = text["hidden_size"] // text["num_attention_heads"]
    ckpt = _with_head_dim(tiny_qwen2_vl, str(tmp_path / "stated"), derived)
    llm = LLM(ckpt, block_size=4, num_kv_blocks=64)
    core = llm.engine.core
    attn = core.model.language_model.layers[0].self_attn
    assert core.shape.head_dim == attn.head_dim == derived
    assert core.runner.kv_caches[0][0].shape[-1] == derived
    assert core.model.cos_sin_cache.shape[-1] == derived
    conv = chat("Describe it.", image(7, 84, 56))
    (out,) = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                      use_tqdm=False)
    p = llm.processor.process_chat(conv)
    want, _ = hf_greedy(load_hf_model(ckpt), p, 6, llm.get_tokenizer().pad_token_id or 0)
    assert out.outputs[0].token_ids == want


def test_a_head_dim_that_differs_is_refused_as_hf_cannot_run_it(tiny_qwen2_vl, tmp_path):
    with open(os.path.join(tiny_qwen2_vl, "config.json")) as f:
        text = json.load(f)["text_config"]
    derived = text["hidden_size"] // text["num_attention_heads"]
    ckpt = _with_head_dim(tiny_qwen2_vl, str(tmp_path / "differs"), 2 * derived)
    hf = load_hf_model(ckpt)  # HF's attention weights have the derived size ...
    assert hf.model.language_model.layers[0].self_attn.head_dim == derived
    with pytest.raises(RuntimeError):  # ... and its rotary tables the stated one
        hf(input_ids=torch.tensor([[1, 2, 3]]))
    from transformers import AutoConfig
    from triptych.engine.sizing.model_shape import ModelShape

    with pytest.raises(ValueError, match=rf"head_dim \({2 * derived}\) differs from "
                                         rf"hidden_size / num_attention_heads \({derived}\)"):
        ModelShape.from_hf(AutoConfig.from_pretrained(ckpt, local_files_only=True))
    with pytest.raises(ValueError, match="head_dim"):
        LLM(ckpt, block_size=4, num_kv_blocks=64)
