"""A 16-bit and an int8 model served end to end (kernels/cpu/linear.py): a real `triptych
serve --dtype bfloat16` / `--quantization int8` and the real openai client. The served
tokens and log-probs are those of the offline engine with the same weight format, and
measurably not fp32's, so a knob lost on the way to the worker fails the test."""
from __future__ import annotations

import os
import sys

import pytest
from triptych.kernels.cpu import linear as cpu_linear

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import data_url, image_part, img, module_server, png, text_part, user

pytestmark = pytest.mark.skipif(not (cpu_linear.available("bfloat16")
                                     and cpu_linear.available("int8")),
                                reason="this torch build lacks oneDNN bf16 or fbgemm int8")

PROMPT = "Once upon a time"
FLAGS = {"bfloat16": ("--dtype", "bfloat16"), "int8": ("--quantization", "int8")}
KNOBS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}


def offline(model: str, fmt: str) -> tuple[list[int], list[float]]:
    from triptych import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=4, num_kv_blocks=64, cpu_threads=1, **KNOBS[fmt])
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    llm.close()
    return list(out.token_ids), [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]


@pytest.fixture(scope="module", params=sorted(FLAGS))
def served(request, tiny_qwen2_vl, tmp_path_factory):
    fmt = request.param
    gen = module_server(tiny_qwen2_vl, tmp_path_factory, *FLAGS[fmt], "--num-kv-blocks",
                        "64", "--cpu-threads", "1", "--served-model-name", "tiny")
    yield fmt, next(gen)
    gen.close()


def test_a_narrow_weight_format_served_through_the_openai_api(served, tiny_qwen2_vl):
    fmt, server = served
    client = server.openai_client()
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=0, extra_body={"return_token_ids": True})
    c = r.choices[0]
    ids, lps = c.model_extra["token_ids"], c.logprobs.token_logprobs
    want_ids, want_lps = offline(tiny_qwen2_vl, fmt)
    _, fp32_lps = offline(tiny_qwen2_vl, "float32")
    assert ids == want_ids
    same = max(abs(a - b) for a, b in zip(lps, want_lps))
    apart = max(abs(a - b) for a, b in zip(want_lps, fp32_lps))
    # bf16 / int8 weights move the log-probs by ~1e-3..1e-2 on this model; the same format
    # in another process differs by summation order only
    assert apart > 5e-4 and same < apart / 5, (same, apart)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=user(image_part(data_url(png(img(3)))), text_part("What is this?")))
    assert chat.choices[0].finish_reason == "length"  # the vision tower ran packed too
