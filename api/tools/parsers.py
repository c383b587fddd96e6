"""Reading tool calls out of model text, per model family (``--tool-call-parser``).

    parser      the model writes                                          models
    hermes      <tool_call>{"name": ..., "arguments": {...}}</tool_call>  Qwen2-VL, Qwen2.5-VL,
                (several in a row: parallel calls)                        Qwen3-VL, InternVL3 on
                                                                          a Qwen2.5 LM
    internlm    <|action_start|><|plugin|>{"name": ...,                   InternVL on an
                "parameters": {...}}<|action_end|>  (one call)            InternLM2/2.5/3 LM

Both are a start tag, a JSON object with the function's name and its arguments, and an end
tag (the last may be missing when the text ends: the call runs to the end). ``read`` gives
the content before the first call and each call as far as the text goes, so the same
reading serves the whole answer (``complete`` calls only) and a stream (every call as far
as it has arrived; api/tools/stream.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from triptych.api.tools.json_scan import escape_controls, scan_object, skip_ws


@dataclass
class CallView:
    """One call as far as the text goes."""

    name: str | None  # None until the name's string has closed
    arguments: str | None  # the arguments' JSON as written so far (None: not begun)
    complete: bool  # name and arguments finished, and the arguments are valid JSON
    bad: bool = False  # this can never become a call (not JSON, no name, ...)


@dataclass
class TextView:
    content: str  # text before the first call (all of it without calls)
    calls: list[CallView]
    held: int = 0  # characters at the end held back: they may begin a start tag


def is_json(raw: str | None) -> bool:
    """Whether ``raw`` is a whole JSON value (arguments that are complete)."""
    if not raw:
        return False
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def read_object(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[CallView, int | None]:
    """The call whose JSON object starts at or after ``text[i]`` (whitespace first):
    (its view, the index after the object or None while it is open)."""
    i = skip_ws(text, i)
    if i >= len(text):
        return CallView(None, None, False), None
    if text[i] != "{":
        return CallView(None, None, False, bad=True), None
    obj = scan_object(text, i)
    name = None
    if obj.complete("name"):
        try:
            v = json.loads(obj.raw(text, "name") or "")
            name = v if isinstance(v, str) else None
        except ValueError:
            name = None
    key = next((k for k in args_keys if k in obj.values), None)
    args = obj.raw(text, key) if key else None
    args = escape_controls(args) if args is not None else None
    done = obj.end is not None and name is not None and (
        args is None or (obj.complete(key) and is_json(args)))
    if obj.end is not None and args is None:
        args = "{}"  # a call that names no arguments takes none
    bad = obj.bad or (obj.end is not None and not done)
    return CallView(name, args, done, bad), obj.end


class TagParser:
    """Calls between a start and an end tag, each a JSON object."""

    name = ""
    start = ""
    end = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    multi = True  # several calls in one answer
    keep_special_tokens = False  # the tags are special tokens the text must keep

    def read(self, text: str) -> TextView:
        first = text.find(self.start)
        if first < 0:
            held = _partial_suffix(text, self.start)
            return TextView(text[:len(text) - held], [], held)
        calls: list[CallView] = []
        pos = first
        while pos >= 0:
            body = pos + len(self.start)
            view, obj_end = read_object(text, body, self.args_keys)
            calls.append(view)
            if obj_end is None or not self.multi:
                break
            close = text.find(self.end, obj_end)
            if close < 0:
                break
            pos = text.find(self.start, close + len(self.end))
        return TextView(text[:first], calls)


class HermesParser(TagParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


class InternLMParser(TagParser):
    name = "internlm"
    start = "<|action_start|><|plugin|>"
    end = "<|action_end|>"
    multi = False
    keep_special_tokens = True


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS: dict[str, type[TagParser]] = {p.name: p for p in (HermesParser, InternLMParser)}


def parser_for(name: str) -> TagParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; this server has "
                         f"{', '.join(sorted(PARSERS))}") from None


__all__ = [
    "PARSERS",
    "CallView",
    "HermesParser",
    "InternLMParser",
    "TagParser",
    "TextView",
    "is_json",
    "parser_for",
    "read_object",
]
