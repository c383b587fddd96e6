"""OpenAI request bodies the server accepts, validated by pydantic so a bad body gets a 400
naming the field. Unknown top-level fields are ignored (OpenAI's SDKs send extras).
Responses are plain dicts in OpenAI's shapes (api/openai_format.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # completions per request
MAX_STOP = 16  # stop strings per request
INT32 = 2**31 - 1  # bound on counts (they must also fit the msgpack wire)
INT64 = 2**63 - 1


class StreamOptions(BaseModel):
    include_usage: bool = False


class URLRef(BaseModel):
    url: str
    detail: str | None = None  # accepted, unused


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: URLRef | str


class VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: URLRef | str


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32)  # vLLM extension
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    ignore_eos: bool = False  # vLLM extension (benchmarks)


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template and the processor read them."""
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[Annotated[int, Field(ge=0, le=INT32)]] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
