"""Qwen3-VL-MoE against HF transformers end to end on a tiny `make-tiny --arch qwen3_vl_moe`
checkpoint: HF's own processor on the raw messages and images, then HF's generate.

The tiny model has one sparse layer (4 experts, top 2) and one dense layer, DeepStack and
an explicit head_dim. The fused experts path (sort by expert, one GEMM pair per expert
over its contiguous slice) must equal HF's experts; the hub's transposed expert layout
loads to the same model. Prompts and greedy ids equal HF's for text, one and two images,
a 4:3 photo, an icon below the minimum, a photo large enough to be resized, several images
in one prompt, multi-turn with prefix hits, chunked prefill, 1e1p1d, E+PD and TP=2 in both
encoder modes.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from triptych import LLM, SamplingParams
from triptych.models.fused_moe import fused_experts, route
from triptych.models.hf_oracle import hf_chat_greedy, load_hf_model, load_hf_processor

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
KNOBS = {"block_size": 4, "kv_cache_memory": "64MiB", "max_model_len": 512}
CONVS = {"text": [{"role": "user", "content": "Tell me a story about a cat."}],
         "one-image": chat("What is in this picture?", image(1, 56, 56)),
         "two-images": chat("Compare these.", image(2, 56, 84), image(3, 112, 56)),
         # 32-pixel cells, 64 x 64 to 512 x 512 pixels' worth
         "photo": chat("What is in this picture?", image(40, 336, 252)),
         "small": chat("Read this icon.", image(41, 30, 20)),
         "large": chat("Describe.", image(42, 800, 600)),
         "several": chat("Compare them.", image(43, 120, 90), image(44, 50, 300),
                         image(45, 512, 384))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen3_vl_moe", str(tmp_path_factory.mktemp("tiny") / "qwen3_vl_moe"))


@pytest.fixture(scope="module")
def oracle(tiny):
    """HF end to end: its processor class and its model on the checkpoint."""
    return load_hf_processor(tiny), load_hf_model(tiny)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, **KNOBS)


def hf_ids(llm: LLM, hf, conv: list[dict]) -> list[int]:
    """HF's greedy ids for ``conv``, after checking our prompt is HF's processor's."""
    prompt, tokens, _ = hf_chat_greedy(hf[1], hf[0], conv, GREEDY.max_tokens)
    assert llm.processor.process_chat(conv).prompt_token_ids == prompt
    return tokens


def test_the_model_has_sparse_and_dense_layers(llm):
    from triptych.models.fused_moe import SparseMoeBlock

    kinds = [type(layer.mlp) for layer in llm.engine.core.model.language_model.layers]
    assert SparseMoeBlock in kinds and len(set(kinds)) == 2


@pytest.mark.parametrize("name", list(CONVS))
def test_greedy_equals_hf(llm, oracle, name):
    (out,) = llm.chat(CONVS[name], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_ids(llm, oracle, CONVS[name])


def test_chunked_prefill_through_an_image(tiny, oracle, llm):
    chunked = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8})
    conv = chat("Describe.", image(4, 128, 128))
    (out,) = chunked.chat(conv, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_ids(llm, oracle, conv)


def test_multi_turn_and_prefix_hits_across_turns(llm, oracle):
    (first,) = llm.chat(CONVS["one-image"], GREEDY, use_tqdm=False)
    answer = llm.get_tokenizer().decode(first.outputs[0].token_ids, skip_special_tokens=True)
    conv = CONVS["one-image"] + [{"role": "assistant", "content": answer},
                                 *chat("And this one? Compare it.", image(6, 84, 84))]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_ids(llm, oracle, conv)
    assert out.num_cached_tokens >= len(first.prompt_token_ids) // 4 * 4 - 4 > 0


@pytest.mark.parametrize("layout", [
    {"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1},  # E+P+D
    {"encode_workers": 1, "decode_workers": 1},  # E+PD
], ids=["1e1p1d", "1e1d"])
def test_pool_layouts(tiny, oracle, llm, layout):
    """The DeepStack payload goes encode -> the prefilling worker, which runs the fused
    experts; chunks of 16 cut the last image's span."""
    convs = [CONVS[n] for n in ("text", "one-image", "several")]
    convs.append(chat("Describe.", image(4, 128, 128)))
    want = [hf_ids(llm, oracle, c) for c in convs]
    pools = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 16}, **layout)
    try:
        assert [o.outputs[0].token_ids for o in pools.chat(convs, GREEDY, use_tqdm=False)] \
            == want
    finally:
        pools.close()


def test_fused_experts_equal_hf_experts(oracle):
    """Random tokens through layer 0's experts: ours (sorted, grouped) and HF's loop."""
    block = oracle[1].model.language_model.layers[0].mlp
    torch.manual_seed(0)
    x = torch.randn(37, block.gate.weight.shape[1])
    with torch.no_grad():
        _, hf_w, hf_ids_ = block.gate(x)
        want = block.experts(x, hf_ids_, hf_w)
        ids, w = route(x, block.gate.weight, block.gate.top_k)
        got = fused_experts(x, block.experts.gate_up_proj, block.experts.down_proj, ids, w)
    assert torch.equal(ids, hf_ids_)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hub_layout_of_the_experts_loads_the_same(tiny, llm, tmp_path):
    """Hub checkpoints store stacked experts as [E, in, out]; HF transposes at load."""
    from safetensors.torch import load_file, save_file

    hub = str(tmp_path / "hub")
    shutil.copytree(tiny, hub)
    path = os.path.join(hub, "model.safetensors")
    t = load_file(path)
    for k in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t[k] = t[k].transpose(1, 2).contiguous()
    save_file(t, path, metadata={"format": "pt"})
    conv = CONVS["one-image"]
    (a,) = llm.chat(conv, GREEDY, use_tqdm=False)
    (b,) = LLM(hub, **KNOBS).chat(conv, GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_tensor_parallel_two_ranks(tiny, oracle, llm, mode):
    """TP=2: each rank holds half of every expert's intermediate dim; one all-reduce; the
    tower sharded ("weights") or the images split across ranks ("data")."""
    convs = [CONVS[n] for n in ("text", "one-image", "two-images", "several")]
    want = [hf_ids(llm, oracle, c) for c in convs]
    two = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 16}, tensor_parallel_size=2,
              mm_encoder_tp_mode=mode)
    try:
        assert [o.outputs[0].token_ids for o in two.chat(convs, GREEDY, use_tqdm=False)] == want
    finally:
        two.close()


def test_a_config_it_cannot_serve_is_refused_in_one_line(tiny, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(tiny, bad)
    cfg_path = os.path.join(bad, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["text_config"]["num_experts_per_tok"] = cfg["text_config"]["num_local_experts"] + 1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="num_experts") as e:
        LLM(bad, **KNOBS)
    assert "\n" not in str(e.value)
