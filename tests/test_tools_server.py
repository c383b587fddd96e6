"""Tool calling through a real `triptych serve` and the real `openai` client, on a random
tiny checkpoint: ``required`` and named choices give valid calls (JSON matching the
function's schema) in every request, streamed or not, colocated and 1e1p1d; ``auto`` reads
the model's own hermes calls (here forced by a regex, since random weights never write
one); later turns carry the calls and their results, images in results included; vLLM's
400s for bad tool fields, and for ``auto`` on a server started without
``--enable-auto-tool-choice --tool-call-parser``.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import openai
from server_fixtures import data_url, image_part, img, module_server, png, text_part, user

ARGS = ("--block-size", "4", "--max-model-len", "768", "--served-model-name", "tiny")
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {"type": "object", "properties": {
    "city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"], "additionalProperties": False}
ZOOM = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                          # (a free string would let random weights
                                          # write bytes that are no UTF-8: U+FFFD)
                                          "label": {"type": "string",
                                                    "pattern": "^[a-z]{1,5}$"}},
        "required": ["x", "label"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "zoom", "description": "Crop the image.",
                                           "parameters": ZOOM}}]
SCHEMAS = {"get_weather": WEATHER, "zoom": ZOOM}
ASK = user(image_part(data_url(png(img(5)))), text_part("What is the weather there?"))
NAMED = {"type": "function", "function": {"name": "zoom"}}


@pytest.fixture(scope="module")
def colocated(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, *ARGS,
                             "--tool-call-parser", "hermes", "--enable-auto-tool-choice")


@pytest.fixture(scope="module")
def pools(tiny_qwen2_vl, tmp_path_factory):
    """1e1p1d, and no tool flags: required / named need none."""
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, *ARGS, "--encode-workers",
                             "1", "--prefill-workers", "1", "--decode-workers", "1")


def check_calls(calls: list, allowed: set[str]) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
        assert c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def stream_calls(client: openai.OpenAI, **kw) -> tuple[list[dict], str | None, str]:
    """A streamed answer's calls as a client assembles them, its finish reason, content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.id:
                calls[tc.index] = {"id": tc.id, "name": tc.function.name,
                                   "arguments": tc.function.arguments or ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        if ch.finish_reason is not None:
            assert finish is None, "finish_reason in more than one chunk"
            finish = ch.finish_reason
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("layout", ["colocated", "pools"])
def test_required_and_named_calls_are_valid_in_every_request(layout, request):
    server = request.getfixturevalue(layout)
    client = server.openai_client()

    def one(seed: int, choice: object, stream: bool) -> None:
        allowed = {"zoom"} if choice == NAMED else {"get_weather", "zoom"}
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
                  max_tokens=200)
        finish = "tool_calls" if choice == "required" else "stop"
        if not stream:
            out = client.chat.completions.create(**kw).choices[0]
            check_calls(out.message.tool_calls, allowed)
            assert out.message.content == "" and out.finish_reason == finish
            return
        calls, got, content = stream_calls(client, **kw)
        assert content == "" and got == finish and calls
        for c in calls:
            assert c["id"].startswith("chatcmpl-tool-") and c["name"] in allowed
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])

    jobs = [(seed, choice, stream) for seed in range(2) for choice in ("required", NAMED)
            for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as ex:  # in flight together: one batch
        for f in [ex.submit(one, *j) for j in jobs]:
            f.result()


def test_greedy_calls_stream_as_they_answer_whole(colocated):
    client = colocated.openai_client()
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, _, _ = stream_calls(client, **kw)
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_parallel_tool_calls_false_gives_one_call(colocated):
    client = colocated.openai_client()
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            max_tokens=200, parallel_tool_calls=False).choices[0]
        assert len(out.message.tool_calls) == 1


HERMES = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
          r'"days": [1-7]\}\}\n</tool_call>')


def test_auto_reads_the_models_hermes_calls(colocated):
    """Random weights never write a call by themselves: a regex makes this one write one,
    and the auto path must read it out (whole and streamed), as it would a real model's."""
    client = colocated.openai_client()
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
              extra_body={"structured_outputs": {"regex": r"Checking\." + HERMES}})
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Checking."
    check_calls(out.message.tool_calls, {"get_weather"})
    calls, finish, content = stream_calls(client, **kw)
    assert finish == "tool_calls" and content == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    # tool_choice none: the same text is content (tools still rendered)
    none = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert none.message.content.startswith("Checking.<tool_call>")


def test_later_turns_carry_calls_and_results_with_images(colocated):
    client = colocated.openai_client()
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice=NAMED, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    one_image = first.usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"]
    result = {"role": "tool", "tool_call_id": call.id, "content": [
        image_part(data_url(png(img(6, 84, 56)))), text_part("the cropped part")]}
    second = client.chat.completions.create(
        model="tiny", messages=[*ASK, first.choices[0].message.model_dump(exclude_none=True),
                                result], tools=TOOLS, tool_choice="required", max_tokens=200)
    check_calls(second.choices[0].message.tool_calls, {"get_weather", "zoom"})
    mm = second.usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"]
    assert mm > one_image  # the tool result's image reached the model
    for args in ("{}", ""):  # vLLM: an empty or "{}" argument string in history
        msg = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "zoom", "arguments": args}}]}
        again = client.chat.completions.create(
            model="tiny", messages=[*ASK, msg, {"role": "tool", "tool_call_id": "c1",
                                                 "content": "done"}], max_tokens=3)
        assert again.choices[0].message.content is not None


@pytest.mark.parametrize("kw, words", [
    ({"tools": []}, "must not be an empty array"),
    ({"tool_choice": "auto"}, "`tools` must be set"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "does not match any"),
    ({"tools": TOOLS, "tool_choice": {}}, "Invalid value for `function`"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "not both"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function name"),
])
def test_bad_tool_fields_are_400s(colocated, kw, words):
    client = colocated.openai_client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, **kw)
    assert words in e.value.body["message"]


def test_auto_without_the_flags_is_a_400_naming_them(pools):
    client = pools.openai_client()
    for choice in ({"tool_choice": "auto"}, {}, {"tool_choice": None}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3,
                                           tools=TOOLS, **choice)
        assert "--enable-auto-tool-choice" in e.value.body["message"]
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3,
                                         tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None  # served: tools rendered, text read
