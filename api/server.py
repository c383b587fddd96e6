"""The OpenAI-compatible HTTP server (P0): FastAPI on uvicorn, engine in P1.

Media fetching, decoding and the HF processor run in a thread pool, never on the event
loop. Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`) and name
the problem without echoing internals.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from triptych.api.engine_client import EngineClient, EngineDeadError
from triptych.api.metrics import Metrics
from triptych.api.processor import InputProcessor, ProcessedPrompt
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest
from triptych.engine.sampling_params import SamplingParams

logger = logging.getLogger("triptych.api")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


class RequestIdMiddleware:
    """Echo the client's x-request-id (or a fresh one) on every response. Pure ASGI, so
    streaming responses still see client disconnects."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = (given.decode("latin-1")[:128] if given else uuid.uuid4().hex).encode("latin-1")

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def build_app(client: EngineClient, processor: InputProcessor, served_model: str,
              max_model_len: int, max_pending: int) -> FastAPI:
    app = FastAPI(title="triptych", docs_url=None, redoc_url=None)
    metrics = Metrics(lambda: client.stats)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        where = ".".join(str(x) for x in errs[0]["loc"]) if errs else None
        msg = errs[0]["msg"] if errs else "invalid request"
        return error_response(400, f"invalid request body: {where}: {msg}",
                              "invalid_request_error", where)

    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = client.alive()
        return JSONResponse({"status": "ok" if ok else "engine_dead",
                             "pools": {"colocated": "ok" if ok else "dead"}},
                            status_code=200 if ok else 503)

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

    def check_load() -> None:
        if client.num_in_flight >= max_pending:
            raise APIError(503, "the server is overloaded; retry shortly", "server_error",
                           headers={"Retry-After": "1"})
        if not client.alive():
            raise APIError(503, "the engine is not running", "server_error")

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

    async def preprocess(fn: Any) -> ProcessedPrompt:
        try:
            return await anyio.to_thread.run_sync(fn)
        except ValueError as e:  # MediaError included: its message is safe to show
            raise APIError(400, str(e)) from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        check_model(body.model)
        check_load()
        prompt = await preprocess(lambda: processor.process_chat(body.messages))
        metrics.mm_cache_queries.inc(len(prompt.mm_items))
        top = (body.top_logprobs or 0) if body.logprobs else None
        sp = sampling(body, len(prompt.prompt_token_ids),
                      body.max_completion_tokens or body.max_tokens, top)
        rid = client.new_request_id("chatcmpl")
        return await respond(rid, prompt, sp, body, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        check_model(body.model)
        check_load()
        prompt = await preprocess(lambda: processor.process_prompt(body.prompt))
        sp = sampling(body, len(prompt.prompt_token_ids), body.max_tokens or 16, body.logprobs)
        rid = client.new_request_id("cmpl")
        return await respond(rid, prompt, sp, body, raw, chat=False)

    async def respond(rid: str, prompt: ProcessedPrompt, sp: SamplingParams, body: Any,
                      raw: Request, chat: bool) -> Any:
        arrival = time.monotonic()
        stream = client.submit(rid, prompt, sp)
        try:
            first = await stream.__anext__()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None
        timing = {"arrival": arrival, "first": time.monotonic()}
        if body.stream:
            return StreamingResponse(
                sse(rid, first, stream, prompt, sp, body, raw, chat, timing),
                media_type="text/event-stream")
        return await collect(rid, first, stream, prompt, sp, chat, timing)

    def piece(rid: str, chat: bool, created: int, choices: list[dict],
              usage: dict | None = None) -> str:
        obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
               "created": created, "model": served_model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n"

    def usage_of(d: Any, n_out: int) -> dict:
        return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": n_out,
                "total_tokens": d.num_prompt_tokens + n_out,
                "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}

    def lp_content(c: Any) -> list[dict] | None:
        if c.logprobs is None:
            return None
        tok = processor.tokenizer
        out = []
        for tid, lps in zip(c.token_ids, c.logprobs):
            ranked = sorted(lps.items(), key=lambda kv: -kv[1])
            out.append({"token": tok.decode([tid]), "logprob": lps.get(tid, ranked[0][1]),
                        "top_logprobs": [{"token": tok.decode([t]), "logprob": v}
                                         for t, v in ranked][:max(len(ranked) - 1, 1)]})
        return out

    async def sse(rid: str, first: Any, stream: AsyncIterator, prompt: ProcessedPrompt,
                  sp: SamplingParams, body: Any, raw: Request, chat: bool,
                  timing: dict) -> AsyncIterator[str]:
        created = int(time.time())
        n_out = 0
        last = first
        if chat:
            yield piece(rid, chat, created, [{"index": i, "delta": {"role": "assistant",
                                                                   "content": ""},
                                              "finish_reason": None} for i in range(sp.n)])
        d = first
        try:
            while True:
                choices = []
                for c in d.completions:
                    n_out += len(c.token_ids)
                    ch: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
                    if chat:
                        ch["delta"] = {"content": c.text} if c.text else {}
                        ch["logprobs"] = ({"content": lp_content(c)} if c.logprobs is not None
                                          else None)
                    else:
                        ch["text"] = c.text
                    choices.append(ch)
                if choices:
                    yield piece(rid, chat, created, choices)
                last = d
                if d.finished:
                    break
                if await raw.is_disconnected():
                    break
                d = await stream.__anext__()
        finally:
            # A disconnect cancels this generator: shield the abort that frees the request
            # in P1 (its blocks, its seat) from that cancellation.
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        if last.finished:
            metrics.observe_request(timing["arrival"], timing["first"], time.monotonic(),
                                    n_out, "stop")
            if body.stream_options and body.stream_options.include_usage:
                yield piece(rid, chat, created, [], usage_of(last, n_out))
            yield "data: [DONE]\n\n"

    async def collect(rid: str, first: Any, stream: AsyncIterator, prompt: ProcessedPrompt,
                      sp: SamplingParams, chat: bool, timing: dict) -> dict:
        texts = [""] * sp.n
        ids: list[list[int]] = [[] for _ in range(sp.n)]
        lps: list[list] = [[] for _ in range(sp.n)]
        reasons: list[str | None] = [None] * sp.n
        d = first
        while True:
            for c in d.completions:
                texts[c.index] += c.text
                ids[c.index] += c.token_ids
                if c.logprobs is not None:
                    lps[c.index] += c.logprobs
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
            if d.finished:
                break
            d = await stream.__anext__()
        n_out = sum(len(x) for x in ids)
        metrics.observe_request(timing["arrival"], timing["first"], time.monotonic(), n_out,
                                reasons[0])
        choices = []
        for i in range(sp.n):
            if chat:
                class _C:  # the shape lp_content reads
                    token_ids, logprobs = ids[i], (lps[i] if sp.logprobs is not None else None)
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "finish_reason": reasons[i],
                                "logprobs": ({"content": lp_content(_C)}
                                             if sp.logprobs is not None else None)})
            else:
                choices.append({"index": i, "text": texts[i], "finish_reason": reasons[i],
                                "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": served_model, "choices": choices,
                "usage": usage_of(d, n_out)}

    return app
