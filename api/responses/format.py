"""Responses API shapes: the response object, its output items, usage, logprobs.

    output: [message {"type": "message", "role": "assistant", "content": [output_text]}]
            and / or [function_call {"type": "function_call", "call_id", "name",
            "arguments"}], in the order the model wrote them (text before calls)
    status: completed | incomplete (max_output_tokens reached) | queued | in_progress
            (background) | cancelled | failed
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from triptych.api.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Outcome:
    """What one generation produced, as the response object reports it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None  # output_text logprobs entries (include=...logprobs)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    message: dict[str, Any] | None = None  # the assistant message, tool calls read out


def output_items(outcome: Outcome, ids: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The output items of a finished generation. ``ids``: item ids already announced in
    a stream (``"msg"``, ``"fc<i>"``, ``"call<i>"``), kept so the final object matches."""
    ids = ids or {}
    msg = outcome.message or {"content": outcome.text}
    items: list[dict[str, Any]] = []
    content = msg.get("content")
    calls = msg.get("tool_calls") or []
    if content or not calls:
        part = {"type": "output_text", "text": content or "", "annotations": []}
        if outcome.logprobs is not None:
            part["logprobs"] = outcome.logprobs
        items.append({"type": "message", "id": ids.get("msg") or new_id("msg"),
                      "status": "completed", "role": "assistant", "content": [part]})
    for i, c in enumerate(calls):
        items.append({"type": "function_call", "id": ids.get(f"fc{i}") or new_id("fc"),
                      "call_id": ids.get(f"call{i}") or c["id"], "name": c["function"]["name"],
                      "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def usage(outcome: Outcome) -> dict[str, Any]:
    out = len(outcome.token_ids)
    return {"input_tokens": outcome.prompt_tokens,
            "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + out}


def response_object(rid: str, req: ResponsesRequest, model: str, created: int,
                    status: str, output: list[dict[str, Any]] | None = None,
                    outcome: Outcome | None = None) -> dict[str, Any]:
    """The response object; ``outcome`` None: not finished (no usage yet)."""
    incomplete = None
    if status == "incomplete":
        incomplete = {"reason": "max_output_tokens"}
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": status, "output": output or [],
        "usage": usage(outcome) if outcome is not None else None,
        "incomplete_details": incomplete, "error": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": req.top_logprobs,
        "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt}, "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {}, "store": req.store, "background": req.background,
        "reasoning": None, "user": req.user,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def chat_logprobs_to_output(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's logprobs entries (api/openai_format.py) as output_text logprobs."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                               "bytes": t["bytes"]} for t in e["top_logprobs"]]}
            for e in content]


__all__ = ["Outcome", "chat_logprobs_to_output", "new_id", "output_items",
           "response_object", "status_of", "usage"]
