"""The OpenAI-compatible HTTP server (P0): FastAPI on uvicorn, engine in P1.

    request -> admit (bounded, else 503) -> media + HF processor (thread pool)
            -> Router.submit -> deltas -> JSON body or SSE chunks -> metrics

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`) and name the
problem without echoing internals. A client that goes away aborts its request in P1.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from triptych.api.metrics import Metrics
from triptych.api.middleware import BodyLimitMiddleware, RequestIdMiddleware, error_response
from triptych.api.openai_format import Choice, Formatter, usage
from triptych.api.processor import InputProcessor, ProcessedPrompt
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest
from triptych.api.router import EngineDeadError, Router
from triptych.engine import wire
from triptych.engine.sampling_params import SamplingParams

logger = logging.getLogger("triptych.api")
DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request looks for a gone client


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "json_invalid"}


def field_path(loc: tuple) -> str:
    """pydantic's error location as the client's field path: union-member labels such as
    ``list[tagged-union[...]]`` or ``URLRef`` dropped, the tag repeated by a tagged union
    collapsed (``messages.0.content.0.image_url.url``)."""
    parts: list[str] = []
    for x in loc:
        x = str(x)
        if "[" in x or x in _TYPE_LABELS or x[:1].isupper() or (parts and parts[-1] == x):
            continue
        parts.append(x)
    return ".".join(parts)


def build_app(client: Router, processor: InputProcessor, served_model: str,
              max_model_len: int, max_pending: int, max_body_bytes: int = 64 << 20,
              on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The app. ``on_shutdown`` runs when the server stops (uvicorn's lifespan), before
    uvicorn re-raises the signal that stopped it: the place to stop the engine process."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="triptych", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    metrics = Metrics(client.stats)
    fmt = Formatter(processor.tokenizer, served_model)
    preprocessing = 0  # requests in the media/processor stage (not yet in the client)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        if not errs:
            return error_response(400, "invalid request body", "invalid_request_error")
        err = max(errs, key=lambda x: len(x["loc"]))  # the deepest: the most specific
        if err["type"] == "json_invalid":
            return error_response(400, "the request body is not valid JSON",
                                  "invalid_request_error")
        where = field_path(err["loc"][1:])
        msg = f"invalid request body: {where}: {err['msg']}" if where else \
            f"invalid request body: {err['msg']}"
        return error_response(400, msg, "invalid_request_error", where or None)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the log gets the details; the client does not
        return error_response(500, "internal server error", "server_error")

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> JSONResponse:
        h = client.health()  # degraded (some workers down, every pool served) is still 200
        return JSONResponse(h, status_code=503 if h["status"] == "unavailable" else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model, "object": "model",
                                            "created": int(time.time()), "owned_by": "triptych",
                                            "max_model_len": max_model_len}]}

    def check_model(name: str | None) -> None:
        if name not in (None, "", served_model):
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{served_model!r}", "not_found_error", "model")

    async def admit_and_preprocess(fn: Any) -> ProcessedPrompt:
        """The bounded queue: requests being preprocessed plus those in the engine."""
        nonlocal preprocessing
        if not client.alive():
            raise APIError(503, "the engine is not running", "server_error")
        if preprocessing + client.num_in_flight >= max_pending:
            raise APIError(503, "the server is overloaded; retry shortly", "server_error",
                           headers={"Retry-After": "1"})
        preprocessing += 1
        try:  # media fetching/decoding and the HF processor: off the event loop
            return await anyio.to_thread.run_sync(fn)
        except ValueError as e:  # MediaError included: its message is meant for clients
            raise APIError(400, str(e)) from None
        finally:
            preprocessing -= 1  # NOTE: no await until submit() counts it in the client

    def sampling(body: Any, prompt_len: int, max_tokens: int | None, logprobs: int | None
                 ) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(max_model_len - prompt_len, 1)
        try:
            return SamplingParams(
                n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                seed=body.seed, max_tokens=max_tokens, stop=body.stop, logprobs=logprobs,
                ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        arrival = time.monotonic()
        check_model(body.model)
        messages = body.message_dicts()
        prompt = await admit_and_preprocess(lambda: processor.process_chat(messages))
        metrics.mm_cache_queries.inc(len(prompt.mm_items))
        top = (body.top_logprobs or 0) if body.logprobs else None
        sp = sampling(body, len(prompt.prompt_token_ids),
                      body.max_completion_tokens or body.max_tokens, top)
        return await respond(client.new_request_id("chatcmpl"), prompt, sp, body, raw, True,
                             arrival)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        arrival = time.monotonic()
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt_in = body.prompt
        if isinstance(prompt_in, list) and prompt_in and isinstance(prompt_in[0], str):
            if len(prompt_in) != 1:
                raise APIError(400, "send one prompt per request (batched prompts are not "
                                    "supported)", param="prompt")
            prompt_in = prompt_in[0]
        prompt = await admit_and_preprocess(lambda: processor.process_prompt(prompt_in))
        sp = sampling(body, len(prompt.prompt_token_ids), body.max_tokens or 16, body.logprobs)
        return await respond(client.new_request_id("cmpl"), prompt, sp, body, raw, False,
                             arrival)

    async def respond(rid: str, prompt: ProcessedPrompt, sp: SamplingParams, body: Any,
                      raw: Request, chat: bool, arrival: float) -> Any:
        stream = client.submit(rid, prompt, sp, stream=bool(body.stream))
        try:
            first = await stream.__anext__()
        except ValueError as e:  # the engine refused it (RequestError)
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None
        timing = (arrival, time.monotonic())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(rid, first, stream, sp, raw, chat, timing,
                                         include_usage), media_type="text/event-stream")
        return await collect(rid, first, stream, sp, raw, chat, timing)

    def observe(timing: tuple[float, float], ids_per_choice: list[int], reason: str | None
                ) -> None:
        metrics.observe_request(timing[0], timing[1], time.monotonic(),
                                max(ids_per_choice, default=0), reason)

    async def sse(rid: str, d: wire.RequestDelta, stream: AsyncIterator[wire.RequestDelta],
                  sp: SamplingParams, raw: Request, chat: bool, timing: tuple[float, float],
                  include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        counts = [0] * sp.n
        offsets = [0] * sp.n
        if chat:
            yield fmt.sse(rid, created, chat, [{"index": i, "delta": {"role": "assistant",
                                                                     "content": ""},
                                                "logprobs": None, "finish_reason": None}
                                               for i in range(sp.n)])
        try:
            while True:
                for c in d.completions:
                    counts[c.index] += len(c.token_ids)
                choices = fmt.chunk_choices(d, chat, sp.logprobs, offsets)
                if choices:
                    yield fmt.sse(rid, created, chat, choices)
                if d.finished:
                    break
                if await raw.is_disconnected():
                    return  # (finally aborts it)
                try:
                    d = await stream.__anext__()
                except (ValueError, EngineDeadError) as e:  # failed mid-way: say so, end
                    status = 503 if isinstance(e, EngineDeadError) else 500
                    yield fmt.sse_error(status, str(e), "server_error")
                    yield "data: [DONE]\n\n"
                    return
        finally:
            # A disconnect cancels this generator: shield the abort that frees the request
            # in P1 (its blocks, its seat) from that cancellation.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        observe(timing, counts, d.completions[0].finish_reason if d.completions else None)
        if include_usage:
            yield fmt.sse(rid, created, chat, [], usage(d, sum(counts)))
        yield "data: [DONE]\n\n"

    async def collect(rid: str, d: wire.RequestDelta, stream: AsyncIterator[wire.RequestDelta],
                      sp: SamplingParams, raw: Request, chat: bool,
                      timing: tuple[float, float]) -> Any:
        choices = [Choice() for _ in range(sp.n)]
        next_check = time.monotonic() + DISCONNECT_CHECK_S
        pending: asyncio.Future | None = None
        try:
            fresh = True  # d not yet added (a wait that times out brings no new delta)
            while True:
                if fresh:
                    for c in d.completions:
                        choices[c.index].add(c)
                    fresh = False
                if d.finished:
                    break
                pending = pending or asyncio.ensure_future(stream.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_CHECK_S)
                if done:
                    d, pending, fresh = pending.result(), None, True
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_CHECK_S
                    if await raw.is_disconnected():
                        logger.info("client gone; aborting %s", rid)
                        return Response(status_code=499)  # nobody reads it
        except ValueError as e:
            raise APIError(500, str(e), "server_error") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None
        finally:
            with anyio.CancelScope(shield=True):
                if pending is not None:  # let the cancelled read unwind before closing
                    pending.cancel()
                    await asyncio.wait({pending})
                await stream.aclose()  # aborts the request in P1 unless it finished
        observe(timing, [len(c.token_ids) for c in choices], choices[0].finish_reason)
        return fmt.whole(rid, int(time.time()), chat, choices, sp.logprobs, d)

    return app
