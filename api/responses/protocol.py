"""The body of POST /v1/responses (OpenAI's Responses API, with vLLM's sampling extras).

Fields that change what the model is asked (``input``, ``instructions``, sampling,
``tools``, ``text.format``) are read; OpenAI's server-side features this server does not
have (built-in tools, conversations, prompt templates) are refused by name in
api/responses/convert.py rather than ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from triptych.api.protocol import INT32, INT64, MAX_LOGPROBS, Text, _Model


class ResponsesRequest(_Model):
    model: str | None = None
    input: Text | list[dict[str, Any]] = Field(min_length=1)
    instructions: Text | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | ...}}
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None  # accepted; this server has no reasoning parser
    # refused by name (convert.py): features of OpenAI's service
    conversation: Any = None
    prompt: Any = None
    # vLLM's sampling extras
    top_k: int | None = Field(None, ge=-1, le=INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: Any = None
    ignore_eos: bool = False
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)
    chat_template_kwargs: dict[str, Any] | None = None


__all__ = ["ResponsesRequest"]
