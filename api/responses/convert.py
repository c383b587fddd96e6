"""A Responses request as the chat request the engine path already serves.

    input (a string, or items)         ->  chat messages
      {"role", "content": str | parts}     user / system / developer (-> system) / assistant
        parts: input_text, output_text    -> text
               input_image {image_url}    -> an image_url part (http(s) or data: URL)
      {"type": "function_call", ...}       -> an assistant turn's tool_calls (consecutive
                                              calls are one turn)
      {"type": "function_call_output"}     -> a tool turn (its output: text, or parts with
                                              images, where the template renders them)
      {"type": "reasoning"}                -> dropped (no reasoning parser here)
    instructions                        ->  a system message first (not inherited)
    previous_response_id                ->  the stored conversation before the input
    tools (flat function definitions)   ->  chat tools; tool_choice {"type": "function",
                                            "name"} -> chat's named choice
    text.format                         ->  response_format
    max_output_tokens, sampling         ->  the same chat fields

``input_image.file_id`` is refused: this server has no Files API (send the image as an
http(s) or data: URL). Items and tools of OpenAI's hosted features are refused by name.
"""
from __future__ import annotations

from typing import Any

from triptych.api.errors import bad_request
from triptych.api.responses.protocol import ResponsesRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _part(part: Any, where: str) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise bad_request(where, f"{where}: a content part is an object with a type")
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise bad_request(f"{where}.text", f"{where}: {kind} needs text")
        return {"type": "text", "text": text}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise bad_request(f"{where}.file_id", f"{where}: input_image.file_id is not "
                                                  "supported (this server has no Files API); "
                                                  "send image_url: an http(s) or data: URL")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{where}.image_url", f"{where}: input_image needs image_url "
                                                    "(an http(s) or data: URL)")
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(f"{where}.type", f"{where}: content part type {str(kind)[:40]!r} is not "
                                       "supported (input_text, input_image, output_text)")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [_part(p, f"{where}.{j}") for j, p in enumerate(content)]
    raise bad_request(where, f"{where}: content is a string or a list of parts")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(f"{where}.role", f"{where}: role must be user, system, "
                                                   "developer or assistant")
            out.append({"role": role, "content": _content(item.get("content"),
                                                           f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where),
                                 "arguments": _text(item, "arguments", where, "")}}
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and last.get("tool_calls") and \
                    not last.get("content"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                        "content": _content(output if output is not None else "",
                                            f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}.type", f"{where}: input item type {str(kind)[:40]!r} "
                                               "is not supported (message, function_call, "
                                               "function_call_output, reasoning)")
    return out


def _text(item: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = item.get(key, default)
    if not isinstance(v, str) or (default is None and not v):
        raise bad_request(f"{where}.{key}", f"{where}: {key} must be a string")
    return v


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"tools.{i}", f"tools.{i}: only function tools are supported, not "
                                        f"{str(kind)[:40]!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request("tool_choice", "tool_choice: only none, auto, required or "
                                             '{"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise bad_request("text.format", "text.format.type must be text, json_schema or "
                                     "json_object")


def chat_fields(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body (as a dict for ChatCompletionRequest) that runs ``req``."""
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise bad_request(name, f"{name} is not supported by this server")
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "logprobs": logprobs, "top_logprobs": req.top_logprobs if logprobs else None,
        "response_format": _response_format(req.text),
        # (an empty tool list is no tools here: OpenAI's SDKs send tools=[])
        "tools": [_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _tool_choice(req.tool_choice) if req.tools else None,
        "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop", "ignore_eos",
                 "cache_salt", "chat_template_kwargs"):
        fields[name] = getattr(req, name)
    return {k: v for k, v in fields.items() if v is not None}


__all__ = ["LOGPROBS_INCLUDE", "chat_fields", "input_messages"]
