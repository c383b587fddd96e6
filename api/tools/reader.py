"""One choice's text read as an answer with tool calls: whole (``message``) or as it streams
(``deltas``), in vLLM's shapes.

    plan.choice   the text is                         tool calls when          finish_reason
    auto          content, then the parser's tags     the parser finds them    "tool_calls"
    named         the function's arguments (JSON)     the JSON is complete     unchanged
    required      [{"name", "parameters"}, ...]       the array is complete    "tool_calls"
                                                                                 (if "stop")

A stream sends each call's header once its name is known (``{"index", "id", "type":
"function", "function": {"name", "arguments": <so far>}}``), then the rest of its
arguments as they arrive (``{"index", "function": {"arguments"}}``); concatenated they are
the arguments of the whole answer. Content is what comes before the first call; characters
that may begin a start tag are held back until the next token tells.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from triptych.api.tools.json_scan import escape_controls, scan_array, skip_ws
from triptych.api.tools.parsers import CallView, TextView, is_json, parser_for, read_object
from triptych.api.tools.plan import ToolPlan


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def read_required(text: str) -> TextView:
    """``required``'s output: a JSON array of {"name", "parameters"} objects."""
    i = skip_ws(text, 0)
    if i >= len(text):
        return TextView("", [])
    if text[i] != "[":
        return TextView("", [CallView(None, None, False, bad=True)])
    objs, end, bad = scan_array(text, i)
    calls = [read_object(text, o.start, ("parameters",))[0] for o in objs]
    if bad and calls:
        calls[-1].bad = True
    elif bad:
        calls = [CallView(None, None, False, bad=True)]
    if end is None:  # the array is still open: its calls are not all there yet
        for c in calls:
            c.complete = c.complete and c is not calls[-1]
    return TextView("", calls)


@dataclass
class _Sent:
    id: str
    args: int = 0  # characters of arguments already streamed


@dataclass
class ToolReader:
    plan: ToolPlan
    _content: int = 0  # content characters streamed
    _calls: list[_Sent] = field(default_factory=list)

    def view(self, text: str) -> TextView:
        choice = self.plan.choice
        if choice == "named":  # the whole text is the arguments
            raw = escape_controls(text[skip_ws(text, 0):].rstrip())
            return TextView("", [CallView(self.plan.named, raw or None, is_json(raw))])
        if choice == "required":
            return read_required(text)
        if choice == "auto" and self.plan.parser:
            return parser_for(self.plan.parser).read(text)
        return TextView(text, [])

    def _usable(self, calls: list[CallView]) -> list[CallView]:
        out = []
        for c in calls:
            if c.bad or c.name is None:
                break
            out.append(c)
        return out[:1] if not self.plan.parallel else out

    # -- streaming ------------------------------------------------------------------------
    def deltas(self, text: str, final: bool) -> dict[str, Any]:
        """What the stream sends for the text so far (``final``: the choice has finished):
        a delta dict with ``content`` and / or ``tool_calls``, possibly empty."""
        view = self.view(text)
        # (the view's content leaves out a held tail; the last delta sends it)
        content = view.content if not final or view.calls else text
        out: dict[str, Any] = {}
        if len(content) > self._content:
            out["content"] = content[self._content:]
            self._content = len(content)
        calls = []
        for i, c in enumerate(self._usable(view.calls)):
            args = c.arguments or ""
            if i >= len(self._calls):
                self._calls.append(_Sent(tool_call_id(), len(args)))
                calls.append({"index": i, "id": self._calls[i].id, "type": "function",
                              "function": {"name": c.name, "arguments": args}})
            elif len(args) > self._calls[i].args:
                calls.append({"index": i, "function": {"arguments": args[self._calls[i].args:]}})
                self._calls[i].args = len(args)
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """The stream's finish reason, once every delta has gone out."""
        if self.plan.choice == "auto" and self._calls:
            return "tool_calls"
        if self.plan.choice == "required" and reason == "stop":
            return "tool_calls"
        return reason

    # -- whole answers --------------------------------------------------------------------
    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the finish reason) of a finished choice."""
        view = self.view(text)
        calls = self._usable(view.calls)
        whole = bool(calls) and len(calls) == len(view.calls[:len(calls)]) and \
            all(c.complete for c in calls) and not any(c.bad for c in view.calls)
        choice = self.plan.choice
        if not whole:
            content = "" if choice == "named" and not text else text
            return {"role": "assistant", "content": content}, reason
        tool_calls = [{"id": tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        msg: dict[str, Any] = {"role": "assistant", "tool_calls": tool_calls}
        if choice == "auto":
            msg["content"] = view.content or None
            return msg, "tool_calls"
        msg["content"] = ""
        return msg, "tool_calls" if choice == "required" and reason == "stop" else reason


__all__ = ["ToolReader", "read_required", "tool_call_id"]
