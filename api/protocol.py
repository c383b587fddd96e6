"""OpenAI request bodies the server accepts, with vLLM's extensions, validated by pydantic so
a bad body gets a 400 naming the field. Field by field this follows vLLM's OpenAI server
(`vllm/entrypoints/openai/protocol.py`); rules that span fields, need the tokenizer or name
a server flag live in api/request_checks.py.

Every float must be finite (NaN / Infinity are refused: they would reach the sampler) and
every int fits the msgpack wire (int64). Unknown top-level fields are ignored, as vLLM and
OpenAI's SDKs expect. Rules that read several fields of the body and nothing else live here
too (``_body_rules``), each refusal located at the field it names, as pydantic's own are:
the body is then consistent before the server-aware pass (api/request_checks.py) sees it.
Responses are plain dicts in OpenAI's shapes (api/openai_format.py).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from triptych.engine.sample.beam_search import MAX_BEAM_WIDTH

INT32 = 2**31 - 1  # bound on counts (they must also fit the msgpack wire)
INT64 = 2**63 - 1
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1000  # characters per stop string (each is searched for after every token)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap on logprob_token_ids


def _utf8(s: str) -> str:
    # JSON can carry lone surrogates ("\ud800"); the tokenizer and the response encoder
    # cannot. Refuse them here, naming the field, instead of failing deep inside.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def field_error(model: str, name: str, message: str, value: Any = None) -> ValidationError:
    """A refusal found by a rule that reads several fields, located at the field it names
    (so the 400's ``param`` is that field, as for pydantic's own errors)."""
    err = PydanticCustomError("value_error", message.replace("{", "{{").replace("}", "}}"))
    return ValidationError.from_exception_data(
        model, [InitErrorDetails(type=err, loc=tuple(name.split(".")), input=value)])


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class URLRef(_Model):
    url: Text | None = Field(None, min_length=1)  # may be left out when a uuid names the item
    detail: Literal["auto", "low", "high"] | None = None  # accepted, unused


def _data_or_uuid(ref: URLRef | None, uuid: str | None, field_name: str) -> None:
    """A media part carries its data, or a uuid the server holds (vLLM: `{}` or null)."""
    if (ref is None or ref.url is None) and uuid is None:
        raise ValueError(f"{field_name}.url is required (or a uuid sent before with the data)")


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: URLRef | None = None  # NOTE: a bare string is refused, as by OpenAI and vLLM
    uuid: Text | None = Field(None, max_length=256)  # vLLM: a client-chosen media id

    @model_validator(mode="after")
    def _needs_data_or_uuid(self) -> ImagePart:
        _data_or_uuid(self.image_url, self.uuid, "image_url")
        return self


class VideoPart(_Model):
    type: Literal["video_url"]
    video_url: URLRef | None = None
    uuid: Text | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _needs_data_or_uuid(self) -> VideoPart:
        _data_or_uuid(self.video_url, self.uuid, "video_url")
        return self


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]
# OpenAI's five roles, and any other (vLLM passes custom roles to the chat template as they
# came: the template decides what a role means, or raises).
Role = Annotated[Text, Field(min_length=1, max_length=64)]


class Message(BaseModel):
    # name, tool_calls, tool_call_id, ... reach the chat template as they came.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class _Common(_Model):
    """Fields both endpoints share (OpenAI's, then vLLM's sampling extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=INT32)  # the server's own cap: --max-n
    best_of: int | None = Field(None, ge=1, le=INT32)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    length_penalty: float = 1.0
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    min_tokens: int = Field(0, ge=0, le=INT32)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False  # n is the beam width (api/beam_client.py)
    early_stopping: bool | Literal["never"] = False  # beam search only (HF's meaning)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # top-k per prompt token
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64)
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM: these ids' logprobs at every output token, whatever their rank (needs logprobs)
    logprob_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LOGPROB_TOKEN_IDS)] | \
        None = None
    add_special_tokens: bool | None = None  # no-op for Qwen2-VL's tokenizer (adds no BOS)
    priority: int = Field(0, ge=-INT64 - 1, le=INT64)
    user: str | None = None
    request_id: str | None = None  # a label only: responses carry ids the server makes
    # vLLM's prefix-cache salt: requests share cached prefixes (and, here, uuids) only
    # with the same salt, within one tenant (api/tenancy.py)
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)
    # vLLM's extension dict (SamplingParams.extra_args): here the no-repeat n-gram guard's
    # knobs, ngram_size / window_size / whitelist_token_ids (api/request_checks.py)
    vllm_xargs: dict[str, int | float | str | list[int | float | str]] | None = None
    # Accepted so that they can be refused by name (api/request_checks.py) rather than
    # silently ignored: each changes what the model would produce.
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    logits_processors: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    kv_transfer_params: Any = None

    @model_validator(mode="after")
    def _body_rules(self) -> _Common:
        model = type(self).__name__
        if self.stream_options is not None and not self.stream:
            raise field_error(model, "stream_options",
                              "stream_options can only be given with stream=true")
        if self.use_beam_search and self.n > MAX_BEAM_WIDTH:
            raise field_error(model, "n", f"n is the beam width with use_beam_search: at most "
                                          f"{MAX_BEAM_WIDTH}", self.n)
        name, max_tokens = self.requested_max_tokens
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise field_error(model, "min_tokens", f"min_tokens ({self.min_tokens}) is larger "
                                                   f"than {name} ({max_tokens})", self.min_tokens)
        return self

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_generation_prompt: bool | None = None  # None: True unless continue_final_message
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Text]] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # checked in api/tools/ (vLLM's rules)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        model = type(self).__name__
        if self.top_logprobs and not self.logprobs:
            raise field_error(model, "top_logprobs", "top_logprobs needs logprobs=true",
                              self.top_logprobs)
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error(model, "continue_final_message", "continue_final_message and "
                              "add_generation_prompt cannot both be true")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and
                                          getattr(m, "tool_calls", None)):
                raise field_error(model, f"messages.{i}.content", f"a {m.role[:64]} message "
                                  "needs content (a string or a list of parts)")
        last = self.messages[-1].content
        if self.continue_final_message and isinstance(last, list) and \
                (not last or last[-1].type != "text"):
            raise field_error(model, "continue_final_message", "the final message must end "
                                                               "with text to be continued")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template and the processor read them."""
        from triptych.api.tools.messages import template_messages

        return template_messages([m.model_dump(exclude_none=True) for m in self.messages])

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_Common):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    # (None or empty is refused by name, as vLLM does: api/request_checks.py)
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]] | None = None
    prompt_embeds: Any = None  # refused by name (api/request_checks.py)
    max_tokens: int | None = Field(16, ge=1, le=INT32)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt, in order (choices are indexed prompt by prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # one token-id prompt
        return list(p)
