"""vLLM's own OpenAI-server tests (the second batch, issue 44), ported to run against one
`triptych serve` of a random tiny Qwen2-VL checkpoint (no hub: the checkpoint is built
here), driven by the real `openai` client or httpx as the originals are, plus
`triptych run-batch` against the same server.

How they were adapted: each keeps its requests and assertions, except where they need a
model that understands (a random checkpoint never decides by itself to call a tool, so the
``auto`` cases make it write Qwen's ``<tool_call>`` through a regex, and the parser must
read that out; schemas with free strings get bounds, as a random model may write past any
length or write bytes that are no UTF-8; assertions on what a real model says, "two
different employees", are left out) or vLLM's internals (those unit tests are not ported).
Token counts are this checkpoint's, asked of its own tokenizer.

    vllm-project/vllm file                                ported here as
    serve/tokenize/test_tokenization.py (9)               test_tokenize_* , test_detokenize,
                                                          test_tokenizer_info_*
    serve/tokenize/test_tokenization_vlm.py (1)           test_tokenize_chat_expands_image_
                                                          placeholders
    serve/tokenize/test_tokenize_then_chat_vlm.py (1)     test_tokenize_then_chat_completion_
                                                          with_image
    openai/completion/test_prompt_validation.py (2)       test_empty_prompt,
                                                          test_out_of_vocab_token_ids (the
                                                          prompt_embeds / hidden-state unit
                                                          tests: vLLM internals, not ported)
    openai/completion/test_completion_text_offset.py (1)  test_stream_text_offset_matches_
                                                          non_stream_with_stop_holdback
    openai/chat_completion/test_logprob_token_ids.py (2)  test_logprob_token_ids_*
    .../test_logprob_token_ids_validation.py (18)         test_rejects_empty_token_ids,
                                                          ..._without_logprobs,
                                                          test_defers_non_list (each over HTTP
                                                          on chat, completions, chat batch)
    .../test_batched_chat_completions.py (8 of 10)        test_batched_* (the harmony and
                                                          parser-mock ones: internals)
    .../test_completion_with_function_calling.py (11)     test_function_tool_use (no
                                                          enable_thinking: no reasoning parser),
                                                          test_no_args_tool_call,
                                                          test_named_tool_use,
                                                          test_inconsistent_tool_choice_and_
                                                          tools, test_max_tokens_with_tool_
                                                          choice_required
    tool_use/test_chat_completion_request_validations.py  test_chat_completion_request_with_*,
      (7 of 10)                                           test_structured_outputs_* (the
                                                          reasoning_content renames: internal)
    .../test_tool_choice_null.py (6)                      test_null_tool_choice_*
    openai/test_run_batch.py (4)                          test_run_batch_* (embeddings, score,
                                                          rerank, audio, reasoning: other
                                                          model kinds)
The Responses API's files are in test_vllm_responses.py; tool_use/test_tool_choice_
required.py's schema and streaming cases in test_tool_parsers.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import jsonschema
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import openai
from server_fixtures import data_url, image_part, img, module_server, png, text_part, user

MODEL = "tiny"
MAX_LEN = 2048


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--block-size", "4",
                             "--max-model-len", str(MAX_LEN), "--served-model-name", MODEL,
                             "--limit-mm-per-prompt", '{"image": 1}',
                             "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                             "--enable-tokenizer-info-endpoint")


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_vl):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_vl)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=120)


# -- serve/tokenize/test_tokenization.py --------------------------------------------------
def test_tokenize_completions(server, tokenizer):
    for add_special in [False, True]:
        prompt = "vllm1 This is a test prompt."
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        r = post(server, "/tokenize", {"add_special_tokens": add_special, "model": MODEL,
                                       "prompt": prompt})
        r.raise_for_status()
        result = r.json()
        assert result["tokens"] == tokens and result["count"] == len(tokens)
        assert result["max_model_len"] == MAX_LEN and result["token_strs"] is None


def _conversations():
    for add_generation in [False, True]:
        for add_special in [False, True]:
            conversation = [{"role": "user", "content": "Hi there!"},
                            {"role": "assistant", "content": "Nice to meet you!"},
                            {"role": "user", "content": "Can I ask a question? vllm1"}]
            for continue_final in [False, True]:
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})
                yield add_generation, add_special, continue_final, conversation


def test_tokenize_chat(server, tokenizer):
    for add_generation, add_special, continue_final, conversation in _conversations():
        prompt = tokenizer.apply_chat_template(
            add_generation_prompt=add_generation, continue_final_message=continue_final,
            conversation=conversation, tokenize=False)
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        r = post(server, "/tokenize", {"add_generation_prompt": add_generation,
                                       "continue_final_message": continue_final,
                                       "add_special_tokens": add_special,
                                       "messages": conversation, "model": MODEL})
        r.raise_for_status()
        result = r.json()
        assert result["tokens"] == tokens and result["count"] == len(tokens)
        assert result["max_model_len"] == MAX_LEN and result["token_strs"] is None


def test_tokenize_chat_with_tools(server, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]
    for add_generation in [False, True]:
        for add_special in [False, True]:
            conversation = [{"role": "user", "content": "What's the weather like in Paris?"}]
            for continue_final in [False, True]:
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})
                prompt = tokenizer.apply_chat_template(
                    add_generation_prompt=add_generation,
                    continue_final_message=continue_final, conversation=conversation,
                    tools=tools, tokenize=False)
                tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
                r = post(server, "/tokenize", {
                    "add_generation_prompt": add_generation,
                    "continue_final_message": continue_final,
                    "add_special_tokens": add_special, "messages": conversation,
                    "model": MODEL, "tools": tools})
                r.raise_for_status()
                assert r.json()["tokens"] == tokens


def test_tokenize_with_return_token_strs(server, tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    r = post(server, "/tokenize", {"prompt": prompt, "model": MODEL,
                                   "return_token_strs": True})
    r.raise_for_status()
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    result = r.json()
    assert result["tokens"] == tokens and result["count"] == len(tokens)
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)


def test_detokenize(server, tokenizer):
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    r = post(server, "/detokenize", {"model": MODEL, "tokens": tokens})
    r.raise_for_status()
    assert r.json() == {"prompt": prompt}


def _info(server) -> dict:
    r = httpx.get(server.base + "/tokenizer_info", timeout=30)
    r.raise_for_status()
    return r.json()


def test_tokenizer_info_basic(server):
    result = _info(server)
    assert isinstance(result["tokenizer_class"], str) and result["tokenizer_class"]


def test_tokenizer_info_schema(server):
    types = {"add_bos_token": bool, "add_prefix_space": bool,
             "clean_up_tokenization_spaces": bool, "split_special_tokens": bool,
             "bos_token": str, "eos_token": str, "pad_token": str, "unk_token": str,
             "chat_template": str, "errors": str, "model_max_length": int,
             "additional_special_tokens": list, "added_tokens_decoder": dict}
    result = _info(server)
    for field, kind in types.items():
        if result.get(field) is not None:
            assert isinstance(result[field], kind), field


def test_tokenizer_info_consistency_with_tokenize(server):
    info = _info(server)
    tok = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world!"}).json()
    assert info["model_max_length"] >= tok["max_model_len"]


def test_tokenizer_info_chat_template(server):
    template = _info(server).get("chat_template")
    assert isinstance(template, str) and template.strip()


# -- serve/tokenize/test_tokenization_vlm.py, test_tokenize_then_chat_vlm.py -----------------
IMAGE_MESSAGES = user(image_part(data_url(png(img(9, 112, 84)))),
                      text_part("Describe this image."))


def test_tokenize_chat_expands_image_placeholders(server, client):
    count = post(server, "/tokenize", {"model": MODEL, "messages": IMAGE_MESSAGES}).json()[
        "count"]
    chat = client.chat.completions.create(model=MODEL, messages=IMAGE_MESSAGES, max_tokens=1)
    assert count == chat.usage.prompt_tokens  # the engine's count, image expanded
    image = chat.usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"]
    assert image == (112 // 28) * (84 // 28) and count > image  # (patch 14, merge 2)


def test_tokenize_then_chat_completion_with_image(server, client):
    messages = user(image_part(data_url(png(img(10, 56, 84)))),
                    text_part("Describe this image briefly."))
    tok = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    tok.raise_for_status()
    assert tok.json()["count"] > 0
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0.0)
    assert chat.choices[0].message.content


# -- openai/completion/test_prompt_validation.py ------------------------------------------
def test_empty_prompt(client):
    with pytest.raises(openai.BadRequestError,
                       match="Either prompt or prompt_embeds must be provided and non-empty."):
        client.completions.create(model=MODEL, prompt=None, max_tokens=5, temperature=0.0,
                                  extra_body={"prompt_embeds": []})


def test_out_of_vocab_token_ids(client):
    with pytest.raises(openai.BadRequestError, match=".*out of vocabulary.*"):
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=5,
                                  temperature=0.0)


# -- openai/completion/test_completion_text_offset.py -------------------------------------
def test_stream_text_offset_matches_non_stream_with_stop_holdback(client):
    """vLLM's builds the chunks by hand; here the server streams them: with a stop string
    the detokenizer holds text back, and the streamed text_offset must not lag."""
    kw = dict(model=MODEL, prompt="Hi", max_tokens=8, logprobs=0, stop=["\n\n"],
              temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    streamed = []
    for chunk in client.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.text_offset
    assert len(whole.text_offset) == 8 and streamed == whole.text_offset
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(8)]


# -- openai/chat_completion/test_logprob_token_ids.py ------------------------------------
def test_logprob_token_ids_returns_requested_ids(client):
    requested = [100, 300, 600]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=1,
        temperature=0, logprobs=True, top_logprobs=len(requested),
        extra_body={"logprob_token_ids": requested, "return_tokens_as_token_ids": True})
    entries = resp.choices[0].logprobs.content[0].top_logprobs
    got = set()
    for e in entries:
        assert e.token.startswith("token_id:")
        got.add(int(e.token.removeprefix("token_id:")))
    sampled_in = not (got - set(requested))
    assert len(got & set(requested)) >= (len(requested) if sampled_in else len(requested) - 1)
    for e in entries:
        assert isinstance(e.logprob, float) and e.logprob <= 0.0


def test_logprob_token_ids_default_behavior_unchanged(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=1,
        temperature=0, logprobs=True, top_logprobs=5)
    entries = resp.choices[0].logprobs.content[0].top_logprobs
    assert len(entries) == 5 and all(e.logprob <= 0.0 for e in entries)


# -- .../test_logprob_token_ids_validation.py (the three request models, over HTTP) --------
BODIES = {"chat": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                            "messages": [{"role": "user", "content": "hi"}]}),
          "completion": ("/v1/completions", {"model": MODEL, "max_tokens": 1,
                                             "prompt": "hi"}),
          "batch": ("/v1/chat/completions/batch", {
              "max_tokens": 1, "messages": [[{"role": "user", "content": "hi"}]]})}


def _logprobs_value(kind: str, flag: bool) -> object:
    return (1 if flag else None) if kind == "completion" else flag


@pytest.mark.parametrize("kind", list(BODIES))
@pytest.mark.parametrize("logprobs", [None, False, True])
def test_rejects_empty_token_ids(server, kind, logprobs):
    path, base = BODIES[kind]
    data = {**base, "logprob_token_ids": []}
    if logprobs is not None:
        data["logprobs"] = _logprobs_value(kind, logprobs)
    r = post(server, path, data)
    assert r.status_code == 400 and "must not be an empty list" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "logprob_token_ids"


@pytest.mark.parametrize("kind", list(BODIES))
def test_rejects_token_ids_without_logprobs(server, kind):
    path, base = BODIES[kind]
    r = post(server, path, {**base, "logprob_token_ids": [100]})
    assert r.status_code == 400 and "when using `logprob_token_ids`" in \
        r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "logprob_token_ids"


@pytest.mark.parametrize("kind", list(BODIES))
@pytest.mark.parametrize("val", [123, "123"])
def test_defers_non_list_to_pydantic(server, kind, val):
    path, base = BODIES[kind]
    r = post(server, path, {**base, "logprobs": _logprobs_value(kind, True),
                            "logprob_token_ids": val})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logprob_token_ids")


# -- openai/chat_completion/test_batched_chat_completions.py ------------------------------
def batch(server, **body) -> httpx.Response:
    return post(server, "/v1/chat/completions/batch", {"model": MODEL, **body})


def test_batched_chat_completions(server):
    r = batch(server, max_tokens=8, messages=[
        [{"role": "user", "content": "Reply with exactly the word: alpha"}],
        [{"role": "user", "content": "Reply with exactly the word: beta"}]])
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and {c["index"] for c in choices} == {0, 1}
    assert all(c["message"]["content"] for c in choices)


def test_batched_chat_completions_with_json_schema(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                          "enum": ["yes", "no"]}},
              "required": ["answer"]}
    r = batch(server, messages=[[{"role": "user", "content": "Is the sky blue? JSON."}],
                                [{"role": "user", "content": "Is fire cold? JSON."}]],
              response_format={"type": "json_schema", "json_schema": {
                  "name": "answer", "schema": schema, "strict": True}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert json.loads(c["message"]["content"])["answer"] in ("yes", "no")


def test_batched_chat_completions_logprobs_not_token_id_placeholders(server):
    r = batch(server, messages=[[{"role": "user", "content": "Reply: alpha"}]], max_tokens=4,
              logprobs=True, top_logprobs=1, return_token_ids=True)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content
    for entry in content:
        assert not entry["token"].startswith("token_id:")
        assert all(not t["token"].startswith("token_id:") for t in entry["top_logprobs"])


def test_batched_chat_completions_return_tokens_as_token_ids(server):
    r = batch(server, messages=[[{"role": "user", "content": "Reply: alpha"}]], max_tokens=4,
              logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(e["token"].startswith("token_id:") for e in content)


def test_batched_chat_completions_logprob_token_ids(server):
    r = batch(server, messages=[[{"role": "user", "content": "Hello"}]], max_tokens=1,
              temperature=0, logprobs=True, top_logprobs=5, logprob_token_ids=[100, 300, 600],
              return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert {e["token"] for e in content[0]["top_logprobs"]} == {
        "token_id:100", "token_id:300", "token_id:600", content[0]["token"]}


def test_batched_echo_does_not_prepend_user_prompt(server):
    r = batch(server, messages=[[{"role": "user", "content": "USER PROMPT"}]], echo=True,
              max_tokens=3)
    assert "USER PROMPT" not in r.json()["choices"][0]["message"]["content"]


def test_batched_echo_prepends_matching_assistant_prefix(server):
    r = batch(server, messages=[[{"role": "user", "content": "USER PROMPT"},
                                 {"role": "assistant", "content": "PREFIX "}]], echo=True,
              add_generation_prompt=False, continue_final_message=True, max_tokens=3)
    assert r.json()["choices"][0]["message"]["content"].startswith("PREFIX ")


def test_batch_rejects_kv_transfer_prompt_token_ids(server):
    r = batch(server, messages=[[{"role": "user", "content": "first"}],
                                [{"role": "user", "content": "second"}]],
              kv_transfer_params={"prompt_token_ids": [10, 20, 30]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


# -- openai/chat_completion/test_completion_with_function_calling.py ----------------------
WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather",
        "parameters": {"type": "object", "strict": True, "properties": {
            "city": {"type": "string", "enum": ["Berlin", "Vienna"], "default": "Vienna"},
            "country": {"type": "string", "enum": ["Germany", "Austria"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "options": {"$ref": "#/$defs/WeatherOptions"}},
            "required": ["country", "unit"],
            "$defs": {"WeatherOptions": {"type": "object", "additionalProperties": False,
                                         "properties": {
                                             "unit": {"type": "string",
                                                      "enum": ["celsius", "fahrenheit"]},
                                             "include_forecast": {"type": "boolean"}}}}}}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Get the weather forecast",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Berlin", "Vienna"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["days", "unit"]}}}]
MESSAGES = [{"role": "user", "content": "Hi! How are you doing today?"},
            {"role": "assistant", "content": "I'm doing well! How can I help you?"},
            {"role": "user", "content": "What is the weather in Berlin and the forecast for "
                                        "the next 5 days, in fahrenheit?"}]
FORCE_HERMES = {"structured_outputs": {"regex": (
    r'<tool_call>\n\{"name": "get_forecast", "arguments": \{"days": [1-7], '
    r'"unit": "fahrenheit"\}\}\n</tool_call>')}}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("tool_choice", ["auto", "required", {
    "type": "function", "function": {"name": "get_current_weather"}}])
def test_function_tool_use(client, stream, tool_choice):
    extra = FORCE_HERMES if tool_choice == "auto" else {}  # see the module note
    kw = dict(messages=MESSAGES, model=MODEL, tools=WEATHER_TOOLS, tool_choice=tool_choice,
              max_tokens=300, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                          **extra})
    if not stream:
        out = client.chat.completions.create(**kw)
        assert out.choices[0].message.tool_calls
        return
    calls = [tc for chunk in client.chat.completions.create(stream=True, **kw)
             if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) > 0


@pytest.mark.parametrize("arguments", ["{}", ""])
def test_no_args_tool_call(client, arguments):
    tools = [{"type": "function", "function": {
        "name": "get_current_time", "description": "The current date and time.",
        "parameters": {"type": "object", "properties": {}, "required": []}}}]
    messages = [{"role": "system", "content": "Use the tools when relevant."},
                {"role": "user", "content": "What time is it now?"}]
    shared = dict(model=MODEL, temperature=0.0, seed=42,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    response = client.chat.completions.create(**shared, messages=messages, tools=tools,
                                              tool_choice="required", max_tokens=60)
    message = response.choices[0].message
    assert message.tool_calls  # (vLLM's "auto": its model decides; required here)
    call = message.tool_calls[0]
    call.function.arguments = arguments
    messages.append(message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "2025-01-01T12:00"})
    final = client.chat.completions.create(**shared, messages=messages,
                                           max_completion_tokens=16)
    assert final.choices[0].message.content is not None and \
        final.choices[0].message.content.strip() != ""


EMPLOYEE = {  # vLLM's sample_json_schema, its strings bounded (see the module note)
    "type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 70},
        "skills": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                   "minItems": 3, "maxItems": 4},
        "work_history": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "company": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                "duration": {"type": "integer", "minimum": 0, "maximum": 40},
                "position": {"type": "string", "enum": ["engineer", "manager"]}},
            "required": ["company", "position"]}}},
    "required": ["name", "age", "skills", "work_history"]}


def test_named_tool_use(client):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "Give an example JSON for an employee profile "
                                            "using the specified tool."}]
    tools = [{"type": "function", "function": {
        "name": "dummy_function_name", "description": "This is a dummy function",
        "parameters": EMPLOYEE}}]
    choice = {"type": "function", "function": {"name": "dummy_function_name"}}
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                         max_completion_tokens=1000, temperature=0.0,
                                         tool_choice=choice)
    message = out.choices[0].message
    assert len(message.content) == 0
    json1 = json.loads(message.tool_calls[0].function.arguments)
    jsonschema.validate(json1, EMPLOYEE)
    messages += [{"role": "assistant", "content": message.tool_calls[0].function.arguments},
                 {"role": "user", "content": "Give me another one with a different name"}]
    output, finishes = [], 0
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                max_completion_tokens=1000, temperature=0.0,
                                                tool_choice=choice, stream=True):
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        assert delta.content is None or len(delta.content) == 0
        if delta.tool_calls and delta.tool_calls[0].function.arguments:
            output.append(delta.tool_calls[0].function.arguments)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1  # only in the last chunk
    jsonschema.validate(json.loads("".join(output)), EMPLOYEE)


def test_inconsistent_tool_choice_and_tools(client):
    messages = [{"role": "user", "content": "Give an example JSON for an employee profile"}]
    tool = {"type": "function", "function": {"name": "dummy_function_name",
                                             "parameters": EMPLOYEE}}
    for kw in ({"tool_choice": {"type": "function", "function": {"name": "dummy_function_name"}}},
               {"tools": [tool], "tool_choice": {"type": "function", "function": {
                   "name": "nondefined_function_name"}}},
               {"tools": [tool], "tool_choice": {}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=messages,
                                           max_completion_tokens=1000, **kw)


@pytest.mark.parametrize("tool_choice", ["required", {
    "type": "function", "function": {"name": "get_current_weather"}}])
def test_max_tokens_with_tool_choice_required(client, tool_choice):
    out = client.chat.completions.create(messages=MESSAGES, temperature=0,
                                         max_completion_tokens=1, model=MODEL,
                                         tools=WEATHER_TOOLS, tool_choice=tool_choice)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.tool_calls is None


# -- tool_use/test_chat_completion_request_validations.py (over HTTP) -------------------
HELLO = [{"role": "user", "content": "Hello"}]
SAMPLE_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}


def test_chat_completion_request_with_no_tools(client, server):
    for extra in ({}, {"tools": None}):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO,
                                                  "max_tokens": 1, **extra})
        assert r.status_code == 200
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "tools": []})
    assert r.status_code == 400 and "must not be an empty array" in r.json()["error"]["message"]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_chat_completion_request_with_tool_choice_but_no_tools(server, tool_choice):
    for extra in ({}, {"tools": None}):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO,
                                                  "tool_choice": tool_choice, **extra})
        assert r.status_code == 400
        assert "When using `tool_choice`, `tools` must be set." in r.json()["error"]["message"]


def test_structured_outputs_with_named_tool_choice_rejected(server):
    r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": HELLO, "tools": [SAMPLE_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "structured_outputs": {"json": {"type": "object"}}})
    assert r.status_code == 400
    assert "structured outputs or tools, not both" in r.json()["error"]["message"]


def test_structured_outputs_with_auto_tool_choice_allowed(client):
    out = client.chat.completions.create(
        model=MODEL, messages=HELLO, tools=[SAMPLE_TOOL], tool_choice="auto", max_tokens=30,
        extra_body={"structured_outputs": {"json": {"type": "object", "properties": {
            "a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}}})
    assert json.loads(out.choices[0].message.content) in ({"a": True}, {"a": False})


def test_multiple_structured_outputs_rejected(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO,
                                              "structured_outputs": {"json": {"type": "object"},
                                                                     "regex": ".*"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


def test_invalid_structured_outputs_type_rejected(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO,
                                              "structured_outputs": 3})
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]


# -- openai/chat_completion/test_tool_choice_null.py (over HTTP) -------------------------
WEATHER = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object", "properties": {}}}}]
FORCED = {"structured_outputs": {"regex": r'<tool_call>\n\{"name": "get_weather", '
                                          r'"arguments": \{\}\}\n</tool_call>'}}


def test_null_tool_choice_defaults_to_auto_like_an_absent_one(server):
    bodies = [{"model": MODEL, "messages": WEATHER, "tools": TOOLS, "max_tokens": 80, **FORCED},
              {"model": MODEL, "messages": WEATHER, "tools": TOOLS, "tool_choice": None,
               "max_tokens": 80, **FORCED}]
    omitted, null = (post(server, "/v1/chat/completions", b).json()["choices"][0]
                     for b in bodies)
    assert omitted["finish_reason"] == null["finish_reason"] == "tool_calls"  # auto: parsed
    assert [c["function"]["name"] for c in null["message"]["tool_calls"]] == ["get_weather"]


def test_null_tool_choice_without_tools_matches_an_absent_one(server):
    for extra in ({}, {"tool_choice": None}):
        assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": WEATHER,
                                                     "max_tokens": 1, **extra}).status_code == 200


def test_null_tool_choice_does_not_conflict_with_structured_outputs(server):
    r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": WEATHER, "tool_choice": None, "max_tokens": 20,
        "temperature": 0,  # (sampled, 20 tokens may end inside the object: not the point)
        "structured_outputs": {"json": {"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}})
    assert r.status_code == 200 and "ok" in json.loads(
        r.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("tool_choice, tools", [("bogus", TOOLS), ("auto", None)])
def test_invalid_tool_choice_is_still_rejected(server, tool_choice, tools):
    body = {"model": MODEL, "messages": WEATHER, "tool_choice": tool_choice}
    if tools is not None:
        body["tools"] = tools
    assert post(server, "/v1/chat/completions", body).status_code == 400


def test_explicit_none_tool_choice_is_untouched(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": WEATHER,
                                              "tools": TOOLS, "tool_choice": "none",
                                              "max_tokens": 80, **FORCED})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] != "tool_calls" and "tool_calls" not in choice["message"]


# -- openai/test_run_batch.py: `triptych run-batch` against the same server ---------------
def _line(cid: str, **over) -> str:
    body = {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world!"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": body, **over})


def _run_batch(server, tmp_path, text: str) -> tuple[subprocess.CompletedProcess, str]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(text)
    p = subprocess.run([sys.executable, "-m", "triptych", "run-batch", "--no-progress",
                        "-i", str(src), "-o", str(out), "--server", server.base],
                       capture_output=True, text=True, timeout=300)
    return p, out.read_text() if out.exists() else ""


def _check_output_line(line: str) -> dict:
    """vLLM's BatchRequestOutput, field by field."""
    d = json.loads(line)
    assert set(d) == {"id", "custom_id", "response", "error"} and isinstance(d["id"], str)
    assert d["response"] is None or set(d["response"]) == {"status_code", "request_id", "body"}
    return d


def test_run_batch_empty_file(server, tmp_path):
    p, out = _run_batch(server, tmp_path, "")
    assert p.returncode == 0, p.stderr[-2000:]
    assert out.strip() == ""


def test_run_batch_completions(server, tmp_path):
    lines = [_line("request-1"), _line("request-2"),
             json.dumps({**json.loads(_line("request-3")), "body": {
                 **json.loads(_line("x"))["body"], "model": "NonExistModel"}}),
             _line("request-4", url="/bad_url"),
             json.dumps({**json.loads(_line("request-5")), "body": {
                 **json.loads(_line("x"))["body"], "stream": "True"}})]
    p, out = _run_batch(server, tmp_path, "\n".join(lines))
    assert p.returncode == 0, p.stderr[-2000:]
    results = [_check_output_line(x) for x in out.strip().split("\n")]
    assert [r["custom_id"] for r in results] == [f"request-{i}" for i in range(1, 6)]
    assert results[0]["error"] is None and results[1]["error"] is None
    assert all(r["error"] is not None for r in results[2:])


def test_run_batch_completions_invalid_input(server, tmp_path):
    lines = [json.dumps({**json.loads(_line("request-1")), "invalid_field": "request-1"}
                        ).replace('"custom_id": "request-1", ', ""), _line("request-2")]
    p, out = _run_batch(server, tmp_path, "\n".join(lines))
    assert p.returncode != 0 and out == ""


def test_run_batch_tool_calling(server, tmp_path):
    tool = {"type": "function", "function": {"name": "get_current_weather", "parameters": {
        "type": "object", "properties": {
            "location": {"type": "string", "enum": ["San Francisco, CA", "Paris"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}
    line = json.dumps({"custom_id": "request-1", "method": "POST",
                       "url": "/v1/chat/completions", "body": {
                           "model": MODEL, "max_tokens": 200, "tools": [tool],
                           "tool_choice": "required", "messages": [
                               {"role": "user", "content": "Weather in San Francisco?"}]}})
    p, out = _run_batch(server, tmp_path, line)
    assert p.returncode == 0, p.stderr[-2000:]
    for raw in out.strip().split("\n"):
        d = _check_output_line(raw)
        assert d["error"] is None
        calls = d["response"]["body"]["choices"][0]["message"]["tool_calls"]
        assert isinstance(calls, list) and len(calls) > 0
        for c in calls:
            assert c["id"] and c["type"] == "function"
            assert c["function"]["name"] == "get_current_weather" and \
                "arguments" in c["function"]


# -- ours: the Responses API on a template that renders instructions -----------------------
def test_responses_instructions_and_earlier_turns_reach_the_prompt(client):
    plain = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    told = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2,
                                   instructions="Finish the answer with QED.")
    assert told.usage.input_tokens > plain.usage.input_tokens
    after = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2,
                                    previous_response_id=told.id)
    # the earlier turn and its answer, not its instructions (OpenAI's: not inherited)
    assert plain.usage.input_tokens < after.usage.input_tokens
    assert after.usage.input_tokens < told.usage.input_tokens + plain.usage.input_tokens + 8
