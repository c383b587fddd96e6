"""Beam search against HF transformers' ``generate(num_beams=k)`` on the same checkpoint.

Outputs have a fixed length (EOS is an ordinary token on both sides: ``ignore_eos`` here,
no EOS id there), so the k sequences and their order must be HF's, and each cumulative
logprob must be HF's ``sequences_scores * len ** length_penalty``. The KV blocks held
during the search show the prompt shared by the beams; the server returns what the
offline ``LLM.beam_search`` returns.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from triptych import LLM, BeamSearchParams
from triptych.engine.sample.beam_search import BeamSearch
from triptych.models.hf_oracle import hf_inputs, load_hf_model, no_eos

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import data_url, image_chat, img, module_server, png  # noqa: E402

BLOCK = 4
TEXT = "Tell me a story about a cat and a dog"


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    hf = load_hf_model(tiny_qwen2_vl)
    no_eos(hf)
    return hf


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, block_size=BLOCK, kv_cache_memory="64MiB")


@torch.inference_mode()
def hf_beams(hf, prompt, k: int, max_tokens: int, length_penalty: float, early_stopping):
    # NOTE: beams never pick image/video placeholders (the tiny random model would).
    banned = [hf.config.image_token_id, hf.config.video_token_id]
    inp = hf_inputs([prompt], 0)
    g = hf.generate(**inp, num_beams=k, num_return_sequences=k, do_sample=False,
                    max_new_tokens=max_tokens, length_penalty=length_penalty,
                    early_stopping=early_stopping, pad_token_id=0, output_scores=True,
                    suppress_tokens=banned,
                    return_dict_in_generate=True)
    n = inp["input_ids"].shape[1]
    return [s[n:].tolist() for s in g.sequences], g.sequences_scores.tolist()


@pytest.mark.parametrize("k,max_tokens,length_penalty,early_stopping", [
    (3, 5, 1.0, False), (4, 4, 0.5, True), (2, 6, 2.0, "never")])
def test_text_matches_hf(llm, oracle, k, max_tokens, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    (out,) = llm.beam_search(TEXT, params)
    seqs, scores = hf_beams(oracle, llm.processor.process_prompt(TEXT), k, max_tokens,
                            length_penalty, early_stopping)
    assert [s.output_token_ids for s in out.sequences] == seqs
    for s, score in zip(out.sequences, scores):
        assert s.cum_logprob == pytest.approx(score * max_tokens ** length_penalty, abs=1e-3)
        assert s.score == pytest.approx(score, abs=1e-3)
        assert s.finish_reason == "length"
        assert s.tokens[-max_tokens:] == s.output_token_ids


def test_image_matches_hf(llm, oracle):
    prompt = llm.processor.process_chat(image_chat("What is in this picture?", img(3)))
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5,
                                                         ignore_eos=True))
    seqs, scores = hf_beams(oracle, prompt, 3, 5, 1.0, False)
    assert [s.output_token_ids for s in out.sequences] == seqs
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(
        [sc * 5 for sc in scores], abs=1e-3)


def test_beams_share_the_prompt_blocks(llm):
    """Peak KV blocks in use during the search: the prompt's once, plus a few per beam."""
    prompt = llm.processor.process_prompt(TEXT * 4)
    num_prompt_blocks = -(-len(prompt.prompt_token_ids) // BLOCK)
    k, max_tokens = 4, 6
    runner, pool = llm.engine.core.runner, llm.engine.core.kv.pool
    peak, execute = 0, runner.execute

    def counting_execute(sched):  # blocks are allocated, the step not yet run
        nonlocal peak
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        return execute(sched)

    runner.execute = counting_execute
    try:
        llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=max_tokens,
                                                   ignore_eos=True))
    finally:
        del runner.execute
    # each beam: its last partial block, and at most one more of its own full blocks
    # (max_tokens < 2 blocks)
    assert num_prompt_blocks < peak <= num_prompt_blocks + 2 * k
    assert peak < k * num_prompt_blocks


def test_finished_beams_follow_hf_rules():
    """EOS candidates in the top k finish, scored cum / len ** length_penalty; early_stopping
    stops the search once k beams finished."""
    s = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5, early_stopping=True), 0, 5)
    s.advance([{0: -0.1, 1: -1.0, 2: -2.0, 3: -3.0}])  # EOS best: finishes at length 1
    assert [f.output_token_ids for f in s.finished] == [[0]]
    assert [b.output_token_ids for b in s.running] == [[1], [2]]
    s.advance([{0: -0.5, 4: -3.0, 5: -4.0, 6: -5.0}, {0: -0.2, 7: -0.5, 8: -4.0, 9: -6.0}])
    # candidates: [1,0] -1.5, [2,0] -2.2, [2,7] -2.5, ...: both EOS ones rank in the top 2
    assert s.done and [f.output_token_ids for f in s.result()] == [[0], [1, 0]]
    assert s.result()[1].score == pytest.approx(-1.5 / 2)


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--block-size", str(BLOCK),
                             "--max-model-len", "512", "--served-model-name", "tiny")


def test_server_matches_offline(server, llm):
    client = server.openai_client()
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.7)
    (want,) = llm.beam_search(TEXT, params)
    extra = {"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.7}
    r = client.completions.create(model="tiny", prompt=TEXT, n=3, max_tokens=5,
                                  temperature=0.0, extra_body=extra)
    assert [c.text for c in r.choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    stream = client.completions.create(model="tiny", prompt=TEXT, n=3, max_tokens=5,
                                       stream=True, extra_body=extra)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [s.text for s in want.sequences]


def test_server_chat_with_image_matches_offline(server, llm):
    url = data_url(png(img(5)))
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe it."}]}]
    (want,) = llm.beam_search([llm.processor.process_chat(conv)],
                              BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    r = server.openai_client().chat.completions.create(
        model="tiny", messages=conv, n=2, max_tokens=4,
        extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.message.content for c in r.choices] == [s.text for s in want.sequences]


def test_server_refuses_too_wide_a_beam(server):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        server.openai_client().completions.create(
            model="tiny", prompt=TEXT, n=11, max_tokens=2, extra_body={"use_beam_search": True})
    assert "beam width" in str(e.value) or "at most" in str(e.value)
