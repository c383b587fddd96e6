"""The last differences from vLLM's OpenAI server (issue 17, point 4), each a regression test
through the real `openai` SDK against `triptych serve` (one server for the module):
logprobs=0 / top_logprobs=0, prompt_logprobs=0, continuous usage stats, custom roles, every
bad logit_bias key named, the context-length wording, out-of-vocabulary prompt ids,
``cache_read_input_tokens``; and the penalties / min_p / n-gram guard in both endpoints.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import module_server, text_part, user  # noqa: E402

openai = pytest.importorskip("openai")
MAX_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--block-size", "4",
                             "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt=prompt, **kw)


def refusal(call) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.response.json()["error"]["message"]


def test_zero_logprobs_give_the_sampled_token_alone(client):
    lp = complete(client, "Once upon a time", logprobs=0,
                  extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: v}  # vLLM: the chosen token, no alternatives
    content = chat(client, user(text_part("Name a colour.")), logprobs=True,
                   top_logprobs=0).choices[0].logprobs.content
    assert len(content) == 4
    assert all(t.logprob <= 0 and t.top_logprobs == [] for t in content)
    streamed = [t for c in chat(client, user(text_part("Name a colour.")), logprobs=True,
                                top_logprobs=0, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert all(t.top_logprobs == [] for t in streamed)


def test_zero_prompt_logprobs_give_each_prompt_tokens_own(client):
    r = complete(client, "Once upon a time there was", max_tokens=1,
                 extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    ids = r.choices[0].model_extra["prompt_token_ids"]
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, d in zip(ids[1:], plp[1:]):
        assert list(d) == [str(tid)] and d[str(tid)]["logprob"] <= 0
    c = chat(client, user(text_part("Hi.")), max_tokens=1,
             extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    ids, plp = c.model_extra["prompt_token_ids"], c.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and all(list(d) == [str(t)] for t, d in zip(ids[1:], plp[1:]))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_as_vllm_sends_them(client, endpoint):
    def stream(**so):
        if endpoint == "chat":
            return list(chat(client, user(text_part("hi")), max_tokens=3, n=2, stream=True,
                             stream_options=so))
        return list(complete(client, ["The cat", "A dog"], max_tokens=3, stream=True,
                             stream_options=so, echo=True))

    # continuous_usage_stats without include_usage: vLLM sends no usage at all
    assert all(c.usage is None for c in stream(include_usage=False,
                                               continuous_usage_stats=True))
    chunks = stream(include_usage=True, continuous_usage_stats=True)
    *body, last = chunks
    assert body and all(c.choices and c.usage is not None for c in body)  # every chunk
    assert last.choices == [] and last.usage.completion_tokens == 6  # then the total
    per_choice: dict[int, list[int]] = {}
    for c in body:
        per_choice.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert sorted(per_choice) == [0, 1]
    for counts in per_choice.values():  # each chunk counts its own choice's tokens so far
        assert counts == sorted(counts) and counts[-1] == 3
    if endpoint == "chat":
        assert body[0].choices[0].delta.role == "assistant" and \
            body[0].usage.completion_tokens == 0
    # include_usage alone: only the last chunk
    chunks = stream(include_usage=True)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage is not None


def test_custom_roles_reach_the_chat_template(client, tiny_qwen2_vl):
    from transformers import AutoTokenizer

    msgs = [{"role": "narrator", "content": "The cat sat."}, {"role": "user", "content": "Go on."}]
    r = chat(client, msgs, extra_body={"return_token_ids": True})
    assert r.choices[0].finish_reason == "length"
    text = AutoTokenizer.from_pretrained(tiny_qwen2_vl).decode(r.model_extra["prompt_token_ids"])
    assert "<|im_start|>narrator\nThe cat sat.<|im_end|>" in text, text


def test_every_bad_logit_bias_key_is_named(client):
    msg = refusal(lambda: chat(client, user(text_part("hi")),
                               logit_bias={"abc": 1, "5": 1, "999999": 2, "x1": 3,
                                           "888888": -1}))
    for key in ("'abc'", "'x1'", "999999", "888888"):
        assert key in msg, msg
    assert "'5'" not in msg


def test_too_long_is_worded_as_clients_parse_it(client):
    head = f"This model's maximum context length is {MAX_LEN} tokens. However, you requested"
    msg = refusal(lambda: chat(client, user(text_part("hi")), max_tokens=600))
    assert msg.startswith(head) and "600 in the completion" in msg, msg
    msg = refusal(lambda: complete(client, "hello", max_tokens=MAX_LEN))
    assert msg.startswith(head), msg
    msg = refusal(lambda: complete(client, [5] * (MAX_LEN + 3), max_tokens=1))
    assert msg.startswith(head), msg
    msg = refusal(lambda: chat(client, user(text_part("word " * 2 * MAX_LEN)), max_tokens=1))
    assert msg.startswith(head), msg


def test_out_of_vocabulary_prompt_ids_say_so(client):
    msg = refusal(lambda: complete(client, [1, 2, 999999, 3, 888888]))
    assert "out of vocabulary" in msg and "999999" in msg and "888888" in msg, msg


def test_usage_carries_cache_read_input_tokens(client):
    msgs = user(text_part("A prompt long enough to fill several KV blocks of four tokens."))
    chat(client, msgs, max_tokens=1)
    for usage in (chat(client, msgs, max_tokens=1).usage,
                  complete(client, "Another prompt that fills a few blocks.", max_tokens=1).usage):
        assert usage.model_extra["cache_read_input_tokens"] == \
            usage.prompt_tokens_details.cached_tokens
    assert chat(client, msgs, max_tokens=1).usage.model_extra["cache_read_input_tokens"] > 0


def test_penalties_in_both_endpoints(client):
    msgs = user(text_part("Tell me a story about a cat."))
    kw = dict(max_tokens=16, extra_body={"return_token_ids": True, "ignore_eos": True})
    plain = chat(client, msgs, **kw)
    ids = plain.model_extra["prompt_token_ids"]
    pen = dict(presence_penalty=1.2, frequency_penalty=0.6)
    xb = {"repetition_penalty": 0.4, "min_p": 0.1, "vllm_xargs": {"ngram_size": 2},
          **kw["extra_body"]}
    a = chat(client, msgs, max_tokens=16, extra_body=xb, **pen).choices[0]
    b = complete(client, ids, max_tokens=16, extra_body=xb, **pen).choices[0]
    assert a.model_extra["token_ids"] == b.model_extra["token_ids"]  # same engine path
    got = a.model_extra["token_ids"]
    assert got != plain.choices[0].model_extra["token_ids"]
    bigrams = list(zip(got, got[1:]))
    assert len(bigrams) == len(set(bigrams))  # the guard held
    xb["vllm_xargs"] = {"ngram_size": 2, "window_size": 4, "whitelist_token_ids": [5, 6]}
    assert complete(client, ids, max_tokens=4, extra_body=xb).choices[0].finish_reason
