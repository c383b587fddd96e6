"""Tool-call parsers and readers (api/tools/) on recorded model outputs: complete, partial,
malformed, several calls; streamed at every chunk boundary, where the pieces a stream sends
must add up to the whole answer's calls; the constraint schemas of ``required`` and named
choices accept exactly the calls a definition allows (xgrammar, the engine's compiler).

Ported from vLLM (tests/tool_use/test_tool_choice_required.py): the ``required`` schema
cases (``test_structured_outputs_json*``, checked with xgrammar where vLLM used outlines'
regex) and its streaming cases (``test_streaming_output_valid*``), run against our reader.
"""
from __future__ import annotations

import json
from copy import deepcopy

import pytest
import xgrammar as xgr
from triptych.api.errors import APIError
from triptych.api.tools.parsers import HermesParser, InternLMParser
from triptych.api.tools.plan import Function, ToolPlan, ToolSettings, constraint, plan_tools
from triptych.api.tools.reader import ToolReader
from xgrammar.testing import _is_grammar_accept_string

WEATHER = Function("get_current_weather", None, {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False})
FORECAST = Function("get_forecast", None, {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False})
FUNCS = (WEATHER, FORECAST)


def plan(choice: str, named: str | None = None, parser: str | None = "hermes",
         parallel: bool = True) -> ToolPlan:
    return ToolPlan(FUNCS, choice, named, parallel, parser)


# -- recorded outputs (Qwen2.5 / Qwen3 write hermes calls like these) ----------------------
ONE = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", '
       '"state": "TX", "unit": "fahrenheit"}}\n</tool_call>')
TWO = ('I will check both.\n<tool_call>\n{"name": "get_current_weather", "arguments": '
       '{"city": "Vienna"}}\n</tool_call>\n<tool_call>\n{"name": "get_forecast", '
       '"arguments": {"city": "Vienna", "days": 5}}\n</tool_call>')
TRICKY = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "a } b \\" '
          '{ <tool_call> </tool_call>", "nested": {"x": [1, {"y": "}"}]}}}\n</tool_call>')
NO_END = '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Köln", "days": 3}}'
UNICODE = ('Sure — 天気.<tool_call>\n{"name": "get_current_weather", "arguments": '
           '{"city": "東京"}}\n</tool_call>')


def whole(text: str, p: ToolPlan, reason: str = "stop") -> tuple[dict, str | None]:
    return ToolReader(p).message(text, reason)


def streamed(text: str, p: ToolPlan, cuts: list[int], reason: str = "stop"
             ) -> tuple[str, list[dict], str | None]:
    """The stream of ``text`` cut at ``cuts``: its content and calls as a client adds
    them up (OpenAI's SDK accumulates by index), and the final finish reason."""
    r = ToolReader(p)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        d = r.deltas(text[:b], b == len(text))
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"],
                                      "arguments": tc["function"]["arguments"]}
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], r.finish_reason(reason)


def calls_of(msg: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg.get("tool_calls") or []]


@pytest.mark.parametrize("text, content, calls", [
    (ONE, None, [("get_current_weather", {"city": "Dallas", "state": "TX",
                                          "unit": "fahrenheit"})]),
    (TWO, "I will check both.\n", [("get_current_weather", {"city": "Vienna"}),
                                    ("get_forecast", {"city": "Vienna", "days": 5})]),
    (TRICKY, None, [("get_current_weather", {"city": 'a } b " { <tool_call> </tool_call>',
                                             "nested": {"x": [1, {"y": "}"}]}})]),
    (NO_END, None, [("get_forecast", {"city": "Köln", "days": 3})]),
    (UNICODE, "Sure — 天気.", [("get_current_weather", {"city": "東京"})]),
], ids=["one", "two-with-content", "braces-and-tags-in-strings", "no-end-tag", "unicode"])
def test_hermes_reads_recorded_calls_whole_and_at_every_split(text, content, calls):
    p = plan("auto")
    msg, reason = whole(text, p)
    assert reason == "tool_calls" and msg["content"] == content and calls_of(msg) == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in msg["tool_calls"])
    for cut in range(1, len(text)):  # every two-chunk split
        got_content, got, reason = streamed(text, p, [cut])
        assert reason == "tool_calls"
        assert got_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls, cut
        # the streamed arguments are the whole answer's, character for character
        assert [c["arguments"] for c in got] == [c["function"]["arguments"]
                                                  for c in msg["tool_calls"]]
    got_content, got, _ = streamed(text, p, list(range(1, len(text))))  # char by char
    assert got_content == (content or "") and len(got) == len(calls)


@pytest.mark.parametrize("text", [
    "The weather is sunny.",  # no call: plain content
    "Use <tool_ to start",  # a partial tag that never completes
    "<tool_call>\n{\"name\": \"get_forecast\", \"arguments\": {\"city\": }}\n</tool_call>",
    "<tool_call>\nnot json at all\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
], ids=["plain", "partial-tag", "bad-json", "not-json", "no-name"])
def test_hermes_leaves_malformed_or_absent_calls_as_content(text):
    msg, reason = whole(text, plan("auto"))
    assert reason == "stop" and msg == {"role": "assistant", "content": text}
    content, got, _ = streamed(text, plan("auto"), list(range(1, len(text))))
    if "<tool_call>" not in text:  # a held-back partial tag is sent at the end
        assert content == text and got == []


def test_a_partial_tag_is_held_back_until_the_next_token_tells():
    r = ToolReader(plan("auto"))
    assert r.deltas("Let me <tool", False) == {"content": "Let me "}
    assert r.deltas("Let me <tool_ca", False) == {}
    assert r.deltas("Let me <tool_cab", False) == {"content": "<tool_cab"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    msg, _ = whole(TWO, plan("auto", parallel=False))
    assert [n for n, _ in calls_of(msg)] == ["get_current_weather"]
    _, got, _ = streamed(TWO, plan("auto", parallel=False), [7, 60, 90])
    assert [c["name"] for c in got] == ["get_current_weather"]


def test_internlm_reads_its_action_tags():
    text = ('Checking.<|action_start|><|plugin|>\n{"name": "get_forecast", "parameters": '
            '{"city": "Oslo", "days": 2}}<|action_end|>')
    p = ToolPlan(FUNCS, "auto", parser="internlm")
    msg, reason = ToolReader(p).message(text, "stop")
    assert reason == "tool_calls" and msg["content"] == "Checking."
    assert calls_of(msg) == [("get_forecast", {"city": "Oslo", "days": 2})]
    assert InternLMParser.keep_special_tokens and not HermesParser.keep_special_tokens
    for cut in range(1, len(text)):
        assert [c["name"] for c in streamed(text, p, [cut])[1]] == ["get_forecast"]


# -- named and required: the text is JSON the grammar forced -----------------------------
def test_named_choice_reads_the_arguments_and_keeps_the_finish_reason():
    p = plan("named", "get_forecast")
    args = '{"city": "Rome", "days": 2}'
    msg, reason = whole(args, p)
    assert reason == "stop" and msg["content"] == "" and \
        calls_of(msg) == [("get_forecast", {"city": "Rome", "days": 2})]
    for cut in range(1, len(args)):
        content, got, reason = streamed(args, p, [cut])
        assert content == "" and reason == "stop" and got[0]["arguments"] == args
    cut_short, reason = whole(args[:9], p, "length")  # max_tokens: no call, nothing lost
    assert reason == "length" and "tool_calls" not in cut_short and \
        cut_short["content"] == args[:9]


def test_required_choice_reads_each_array_element_as_a_call():
    p = plan("required")
    out = [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}},
           {"name": "get_current_weather", "parameters": {"city": "a } b"}}]
    text = json.dumps(out)
    msg, reason = whole(text, p)
    assert reason == "tool_calls" and msg["content"] == ""
    assert calls_of(msg) == [(o["name"], o["parameters"]) for o in out]
    short, reason = whole(text[:-2], p, "length")
    assert reason == "length" and "tool_calls" not in short


# vLLM: tests/tool_use/test_tool_choice_required.py, the streaming cases
VALID_TOOLS = [
    [{"name": "get_current_weather", "parameters": {"city": "Vienna"}}],
    [{"name": "get_current_weather", "parameters": {"city": "Vienna"}},
     {"name": "get_current_weather", "parameters": {"city": "Berlin"}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}},
     {"name": "get_current_weather", "parameters": {"city": "Vienna"}}],
    [{"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}},
     {"name": "get_current_weather", "parameters": {"city": "Vienna"}},
     {"name": "get_forecast", "parameters": {"city": "Berlin", "days": 7}},
     {"name": "get_current_weather", "parameters": {"city": "Berlin"}}],
]


def _required_stream(text: str, delta_len: int) -> list[dict]:
    _, got, reason = streamed(text, plan("required"), list(range(delta_len, len(text),
                                                                 delta_len)))
    assert reason == "tool_calls"
    return [{"name": c["name"], "parameters": json.loads(c["arguments"])} for c in got]


@pytest.mark.parametrize("output", VALID_TOOLS)
@pytest.mark.parametrize("empty_params", [False, True])
@pytest.mark.parametrize("delta_len", [1, 2, 3, 5, 8, 10])
def test_streaming_output_valid(output, empty_params, delta_len):
    output = deepcopy(output)
    if empty_params:
        output = [{"name": o["name"], "parameters": {}} for o in output]
    assert _required_stream(json.dumps(output), delta_len) == output


@pytest.mark.parametrize("city", ["a { b", "a } b", "a }} b", 'a " } b', r"a \ } b"])
@pytest.mark.parametrize("delta_len", [1, 2, 3, 8, 9999])
def test_streaming_output_valid_with_braces_in_string(city, delta_len):
    output = [{"name": "get_current_weather", "parameters": {"city": city}}]
    assert _required_stream(json.dumps(output), delta_len) == output


def test_streaming_output_valid_with_trailing_extra_data():
    output = [{"name": "get_current_weather", "parameters": {"city": "Vienna"}}]
    assert _required_stream(json.dumps(output) + "\nDONE", 3) == output


# vLLM: the same file's schema cases, checked by the engine's grammar compiler
def accepts(p: ToolPlan, sample: object) -> bool:
    c = constraint(p)
    g = xgr.Grammar.from_json_schema(json.dumps(c["json"]), any_whitespace=False,
                                     strict_mode=True)
    return _is_grammar_accept_string(g, json.dumps(sample))


@pytest.mark.parametrize("sample, ok", [(t, True) for t in VALID_TOOLS] + [
    (None, False), ([], False), ({}, False), ([{}], False),
    ([{"name": "get_current_weather"}], False),
    ([{"name": "get_current_weather", "parameters": {}}], False),
    ([{"name": "get_current_weather", "parameters": None}], False),
    ({"name": "get_current_weather", "parameters": {"city": "Vienna"}}, False),
    ([{"name": "get_current_weather", "parameters": {"city": "Vienna", "extra": "v"}}], False),
    ([{"parameters": {"city": "Vienna"}, "name": "get_current_weather"}], False),
    ([{"name": "get_forecast", "parameters": {"city": "Vienna"}}], False),
    ([{"name": "get_weather", "parameters": {"city": "Vienna", "days": 7}}], False),
    ([{"name": "get_current_weather", "parameters": {"city": "Vienna"}}, {}], False),
])
def test_structured_outputs_json(sample, ok):
    assert accepts(plan("required"), sample) is ok


@pytest.mark.parametrize("params", [None, {}])
@pytest.mark.parametrize("sample, ok", [
    (None, False), ([], False), ({}, False), ([{}], False),
    ([{"name": "get_current_weather"}], False),
    ([{"name": "get_current_weather", "parameters": None}], False),
    ([{"name": "get_current_weather", "parameters": {"extra": "value"}}], False),
    ([{"name": "get_current_weather", "parameters": {}}], True),
])
def test_structured_outputs_json_without_parameters(params, sample, ok):
    p = ToolPlan((Function("get_current_weather", None, params),), "required")
    assert accepts(p, sample) is ok


def test_named_schema_is_the_functions_parameters_with_their_defs():
    f = Function("f", None, {"type": "object", "properties": {"o": {"$ref": "#/$defs/O"}},
                             "required": ["o"], "$defs": {"O": {"enum": ["a", "b"]}}})
    p = ToolPlan((f,), "named", "f")
    assert accepts(p, {"o": "a"}) and not accepts(p, {"o": "c"})
    assert not accepts(ToolPlan((f,), "required", parallel=False),
                       [{"name": "f", "parameters": {"o": "a"}}] * 2)


# -- vLLM's tool_choice rules --------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
AUTO = ToolSettings("hermes", True)


@pytest.mark.parametrize("tools, choice, words", [
    ([], None, "must not be an empty array"),
    (None, "auto", "When using `tool_choice`, `tools` must be set."),
    (None, "required", "When using `tool_choice`, `tools` must be set."),
    ([TOOL], "bogus", "Only named tools"),
    ([TOOL], {}, "Invalid value for `function`"),
    ([TOOL], {"type": "function", "function": {}}, "Expected field `name`"),
    ([TOOL], {"type": "function", "function": {"name": "x"}}, "does not match any"),
    ([{"type": "code_interpreter"}], "required", "only function tools"),
])
def test_tool_choice_validation_as_vllm(tools, choice, words):
    with pytest.raises(APIError, match=words.replace("`", ".").replace("(", ".")):
        plan_tools(tools, choice, None, AUTO)


def test_auto_needs_the_servers_flags_and_null_means_auto():
    for choice in (None, "auto"):
        with pytest.raises(APIError, match="--enable-auto-tool-choice and "
                                           "--tool-call-parser"):
            plan_tools([TOOL], choice, None, ToolSettings())
        assert plan_tools([TOOL], choice, None, AUTO).choice == "auto"
    assert plan_tools([TOOL], "none", None, ToolSettings()).choice == "none"
    assert plan_tools(None, None, None, ToolSettings()) is None
    assert plan_tools([TOOL], "required", None, ToolSettings()).constrained


def test_control_characters_in_strings_are_escaped_whole_and_streamed():
    """xgrammar's JSON strings let a weak model write a raw control character, which JSON
    forbids: the arguments carry its escape instead, in a stream as in the whole answer."""
    text = '[{"name": "get_current_weather", "parameters": {"city": "\x0b]u\te"}}]'
    msg, reason = whole(text, plan("required"))
    assert reason == "tool_calls"
    args = msg["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"city": "\x0b]u\te"} and "\x0b" not in args
    for cut in range(1, len(text)):
        assert streamed(text, plan("required"), [cut])[1][0]["arguments"] == args
