"""Earlier tool turns as chat templates read them.

An assistant turn that called tools comes back as OpenAI sends it: ``tool_calls`` with each
call's ``arguments`` as a JSON *string*. Templates write the arguments with ``| tojson``
(Qwen's do, for a non-string), so, as vLLM does, the string is parsed back into an object
first; one that is not JSON is left as it came. ``role: "tool"`` turns keep their
``tool_call_id`` and content (text, or parts with images where the template renders them:
the processor takes the images from any turn).
"""
from __future__ import annotations

import json
from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_call(c) for c in calls]}
        out.append(m)
    return out


def _call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return call
        return {**call, "function": {**fn, "arguments": args}}
    return call


__all__ = ["template_messages"]
