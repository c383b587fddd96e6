"""vLLM's /tokenize and /detokenize (and, behind --enable-tokenizer-info-endpoint,
/tokenizer_info): count a prompt's tokens before sending it.

    POST /tokenize {"prompt", "add_special_tokens"=true, "return_token_strs"}
    POST /tokenize {"messages", "add_generation_prompt"=true, "continue_final_message",
                    "add_special_tokens"=false, "tools", "chat_template_kwargs", ...}
         -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize {"tokens"} -> {"prompt"}

Chat bodies go through the same checks and the same InputProcessor as
/v1/chat/completions, so an image counts as many tokens as the engine will give it
(its placeholder expanded). Nothing is left behind: the processor-cache index is only
peeked at (P0's index mirrors the workers' caches and must not learn of items they never
received), the processor's counters are not touched. Tenant-scoped like every route: the
key is checked before the body is read, and uuids resolve in the caller's scope.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError
from triptych.api.errors import APIError, bad_request
from triptych.api.media.decode import MediaError, PixelBudget
from triptych.api.media_items import _Counts
from triptych.api.protocol import ChatCompletionRequest, Message, Text, TokenId, _Model
from triptych.api.request_checks import check_chat
from triptych.api.tenancy import tenant_of


class TokenizeCompletion(_Model):
    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False
    cache_salt: Text | None = None


class TokenizeChat(_Model):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    documents: list[dict[str, Text]] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: Text | None = None


class Detokenize(_Model):
    model: str | None = None
    tokens: list[TokenId]


class _Peek:
    """A processor-cache index seen read-only (see the module note)."""

    def __init__(self, index: Any) -> None:
        self._index = index

    def lookup(self, key: str) -> Any:
        return self._index.peek(key)

    def put(self, key: str, meta: Any) -> bool:
        return False

    def discard(self, key: str) -> None:
        pass


def _special_ids(tok: Any) -> tuple[list[int], list[int]]:
    """What add_special_tokens puts around a text (Qwen's tokenizers: nothing)."""
    marked = tok.encode("a", add_special_tokens=True)
    plain = tok.encode("a", add_special_tokens=False)
    if not plain:
        return [], []
    at = next((i for i in range(len(marked)) if marked[i:i + len(plain)] == plain), None)
    if at is None:
        return [], []
    return marked[:at], marked[at + len(plain):]


def add_tokenize_routes(app: FastAPI, stage: Any, check_model: Any, tokenizer_info: bool,
                        validation_response: Any) -> None:
    """``stage``: the server's InputStage (processor, limits, media fetcher, admission);
    ``check_model`` and ``validation_response``: the server's (api/server.py)."""
    processor, limits = stage.processor, stage.limits
    tok = processor.tokenizer
    head, tail = _special_ids(tok)

    def parse(kind: type[_Model], data: Any) -> Any:
        try:
            return kind.model_validate(data)
        except ValidationError as e:
            raise _Invalid(validation_response(list(e.errors()), body_prefix=False)) from None

    async def body_of(raw: Request) -> Any:
        try:
            return await raw.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None

    async def chat_ids(body: TokenizeChat, raw: Request) -> list[int]:
        fields = body.model_dump(exclude_none=True, exclude={"add_special_tokens",
                                                             "return_token_strs"})
        if body.tools:  # rendered by the template; nothing is parsed out of an answer here
            fields["tool_choice"] = "none"
        chat = ChatCompletionRequest.model_validate(fields)
        checked = check_chat(chat, limits, tenant_of(raw.scope))  # the validation pass
        assert checked.media is not None
        media = dataclasses.replace(checked.media,
                                    budget=PixelBudget(checked.media.max_request_pixels))
        view = processor.for_request(media, False, checked.scope, checked.tenant)
        view.cache = _Peek(processor.cache) if processor.cache is not None else None
        view.counts = _Counts()
        messages, kwargs = checked.messages, checked.template_kwargs
        # decoding images is work: admitted like any request's
        slots = await stage._admit(checked, checked.tenant)
        prompt = None
        try:
            try:
                await stage.fetcher.prefetch(messages, media)
            except MediaError as e:
                raise APIError(400, str(e), param=e.param or "messages") from None
            prompt = await _run(lambda: view.process_chat(
                messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=kwargs))
        finally:
            slots.release_all()
            if prompt is not None:
                prompt.release()  # (prepared pixels: counted, never run)
        ids = list(prompt.prompt_token_ids)
        return head + ids + tail if body.add_special_tokens else ids

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        data = await body_of(raw)
        if not isinstance(data, dict) or not ("messages" in data or "prompt" in data):
            raise bad_request(None, "a tokenize request has messages (chat) or prompt")
        try:
            body = parse(TokenizeChat if "messages" in data else TokenizeCompletion, data)
        except _Invalid as e:
            return e.response
        check_model(body.model)
        if isinstance(body, TokenizeChat):
            if body.continue_final_message and body.add_generation_prompt:
                raise bad_request("continue_final_message", "continue_final_message and "
                                  "add_generation_prompt cannot both be true")
            ids = await chat_ids(body, raw)
        else:
            if len(body.prompt) > limits.prompt_chars:
                raise bad_request("prompt", f"the prompt has {len(body.prompt)} characters; "
                                            f"this server takes at most {limits.prompt_chars} "
                                            "(--max-prompt-chars)")
            text = body.prompt
            ids = await _run(lambda: tok.encode(text, add_special_tokens=body.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": limits.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        try:
            body = parse(Detokenize, await body_of(raw))
        except _Invalid as e:
            return e.response
        check_model(body.model)
        if len(body.tokens) > limits.prompt_chars:
            raise bad_request("tokens", f"{len(body.tokens)} tokens; at most "
                                        f"{limits.prompt_chars} (--max-prompt-chars)")
        bad = sorted({t for t in body.tokens if t >= limits.vocab_size})
        if bad:
            raise bad_request("tokens", f"token ids out of vocabulary: {bad[:5]} (the "
                                        f"vocabulary is [0, {limits.vocab_size}))")
        return JSONResponse({"prompt": await _run(lambda: tok.decode(body.tokens))})

    if tokenizer_info:
        @app.get("/tokenizer_info")
        async def info() -> JSONResponse:
            return JSONResponse(_info(tok, limits.max_model_len))


class _Invalid(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


async def _run(fn: Any) -> Any:
    from jinja2 import TemplateError

    try:
        return await anyio.to_thread.run_sync(fn)
    except ValueError as e:  # MediaError included: worded for clients
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    except TemplateError as e:
        raise APIError(400, f"the chat template refused the messages: {e}",
                       param="messages") from None


def _info(tok: Any, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's settings as JSON values (vLLM's /tokenizer_info fields)."""
    def text(v: Any) -> str | None:
        return None if v is None else str(v)

    added = {str(i): {"content": str(t.content), "special": bool(t.special)}
             for i, t in tok.added_tokens_decoder.items()}
    return {"tokenizer_class": type(tok).__name__,
            "bos_token": text(tok.bos_token), "eos_token": text(tok.eos_token),
            "pad_token": text(tok.pad_token), "unk_token": text(tok.unk_token),
            "chat_template": tok.chat_template if isinstance(tok.chat_template, str) else None,
            "model_max_length": max(int(min(tok.model_max_length, 2**31 - 1)),
                                    max_model_len),
            "clean_up_tokenization_spaces": bool(getattr(tok, "clean_up_tokenization_spaces",
                                                         False)),
            "additional_special_tokens": [str(t) for t in tok.all_special_tokens],
            "added_tokens_decoder": added}


__all__ = ["add_tokenize_routes"]
