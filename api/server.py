"""The OpenAI-compatible HTTP server (P0): FastAPI on uvicorn, workers behind the Router.

    request -> schema (api/protocol.py) -> checks, admission, media, processor (api/prepare.py)
            -> Router.submit per prompt -> JSON body or SSE chunks (api/serving.py)

Endpoints as vLLM's OpenAI server: /v1/chat/completions, /v1/completions, /v1/models,
/v1/models/{id}, /invocations (SageMaker: chat or completion by body shape), /health, /ping,
/version, /metrics. Every error, 404 and 405 included, is OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``), names the field and the problem, and
echoes nothing internal.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from triptych import __version__
from triptych.api.admission import Admission, Slots
from triptych.api.beam_client import BeamClient
from triptych.api.errors import APIError
from triptych.api.media.prefetch import MediaFetcher
from triptych.api.metrics import Metrics
from triptych.api.middleware import BodyLimitMiddleware, RequestIdMiddleware, error_response
from triptych.api.openai_format import Formatter, Shape
from triptych.api.prepare import InputStage
from triptych.api.processor import InputProcessor
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest
from triptych.api.request_checks import ServerLimits
from triptych.api.serving import Generation, Job, Responder
from triptych.api.surface_flags import SurfaceConfig
from triptych.api.tenancy import AuthMiddleware, Tenants, sees_detail, tenant_of
from triptych.api.tools.checks import chat_plan

logger = logging.getLogger("triptych.api")
_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "json_invalid"}
_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


@dataclass(frozen=True)
class AppConfig:
    served_model: str  # the name clients send
    limits: ServerLimits
    model_root: str | None = None  # what /v1/models reports as root (the --model value)
    max_pending: int = 256  # engine sequences admitted at once; more get 429
    pending_share: float = 0.5  # of them, the most one tenant holds (with several tenants)
    max_body_bytes: int = 64 << 20
    max_body_values: int = 1 << 20  # commas in a body; more get 413 before it is parsed
    max_inflight_body_bytes: int = 256 << 20  # request bodies held at once; more get 429
    body_timeout_s: float = 30.0  # a body must arrive within this ...
    body_min_rate: int = 64 << 10  # ... plus a second per this many bytes received; else 408
    body_share: float = 0.5  # most of the body budget one client address / tenant holds
    max_media_fetches: int = 32  # http(s) media fetched at once, server-wide
    block_size: int = 16
    enable_prefix_caching: bool = True
    cache_info: dict[str, str] = field(default_factory=dict)  # cache_config_info labels
    tenants: Tenants = field(default_factory=Tenants)  # API keys (none: an open server)
    protect_metrics: bool = False  # /metrics needs a key too
    surface: SurfaceConfig = field(default_factory=SurfaceConfig)  # tools, responses store


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


def validation_response(errors: list[dict], body_prefix: bool) -> JSONResponse:
    """The most specific pydantic error as an OpenAI 400 naming the field (never the value)."""
    if not errors:
        return error_response(400, "invalid request body", "invalid_request_error")
    # The deepest error is the most specific; among equals (union members), one about a
    # value in the right shape beats "wrong type", which only says another member was meant.
    err = max(errors, key=lambda x: (len(x["loc"]), not str(x["type"]).endswith(
        ("_type", "_parsing", "union_tag_invalid"))))
    if err["type"] == "json_invalid":
        return error_response(400, "the request body is not valid JSON", "invalid_request_error")
    where = field_path(err["loc"][1:] if body_prefix else err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    text = f"invalid request body: {where}: {msg}" if where else f"invalid request body: {msg}"
    return error_response(400, text, "invalid_request_error", where or None)


def build_app(client: Any, processor: InputProcessor, config: AppConfig,
              on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The app. ``on_shutdown`` runs when the server stops (uvicorn's lifespan), before
    uvicorn re-raises the signal that stopped it: the place to stop the engine process."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # several tenants: the grammar compile processes start with the server (their
        # start-up would otherwise slow the others when one tenant first asks for one)
        warm = asyncio.create_task(stage.grammars.prewarm()) if config.tenants.several \
            else None
        yield
        if warm is not None:
            warm.cancel()
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="triptych", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    limits = config.limits
    admission = Admission(config.max_pending, config.pending_share, config.tenants.several)
    stage = InputStage(processor, limits, admission, MediaFetcher(config.max_media_fetches),
                       client.alive)
    metrics = Metrics(client.stats, config.served_model, limits.max_model_len,
                      config.cache_info, lambda: stage.num_mm_items)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_response(list(e.errors()), body_prefix=True)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # 404/405 and FastAPI's own body errors (e.g. a body that is not UTF-8)
        detail = e.detail if isinstance(e.detail, str) else "invalid request"
        return error_response(e.status_code, detail, _HTTP_TYPES.get(e.status_code,
                              "invalid_request_error"), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")  # the log gets the details; the client does not
        return error_response(500, "internal server error", "server_error")

    # NOTE: added last = runs first: ids, then the key (no body is read for a caller
    # without one), then the body cap.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes,
                       max_inflight_bytes=config.max_inflight_body_bytes,
                       timeout_s=config.body_timeout_s, min_rate=config.body_min_rate,
                       share=config.body_share, max_values=config.max_body_values,
                       prechecks={"/v1/chat/completions": functools.partial(
                           limits.template.raw_bound, max_chars=limits.prompt_chars)})
    app.add_middleware(AuthMiddleware, tenants=config.tenants,
                       protect_metrics=config.protect_metrics)
    app.add_middleware(RequestIdMiddleware)

    from triptych.api.admin import add_admin_routes

    add_admin_routes(app, client)

    @app.get("/health")
    async def health(raw: Request) -> JSONResponse:
        h = client.health()  # degraded (some workers down, every pool served) is still 200
        code = 503 if h["status"] == "unavailable" else 200
        if processor.prep is not None:
            h = {**h, "preparation": {"pids": processor.prep.pids,
                                      "killed": processor.prep.num_killed,
                                      "jobs": processor.prep.num_jobs}}
        if not sees_detail(raw.scope, config.tenants):  # pids, errors, nodes: operator's
            h = {"status": "ok" if code == 200 else "unavailable"}
        return JSONResponse(h, status_code=code)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(raw: Request) -> JSONResponse:
        # NOTE: reads no body (vLLM answers POST too); BodyLimitMiddleware passes it by
        return await health(raw)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus(raw: Request) -> Response:
        # NOTE: on a keyed server only the operator sees the shared caches' counters: a
        # tenant could read from them whether another tenant sent an image (api/metrics.py)
        view = metrics.registry if sees_detail(raw.scope, config.tenants) \
            else metrics.tenant_view
        return Response(generate_latest(view), media_type=CONTENT_TYPE_LATEST)

    def model_card(raw: Request) -> dict:
        # NOTE: the checkpoint's place on the server's disk is the operator's to see (an
        # open server's user is the operator); a tenant sees the hub id or the served name.
        root = config.model_root or config.served_model
        local = os.path.expanduser(root)
        if not sees_detail(raw.scope, config.tenants) and \
                (os.path.isabs(local) or os.path.exists(local) or root.startswith(".")):
            root = config.served_model
        return {"id": config.served_model, "object": "model", "created": int(time.time()),
                "owned_by": "triptych", "root": root,
                "parent": None, "max_model_len": limits.max_model_len, "permission": []}

    @app.get("/v1/models")
    async def models(raw: Request) -> dict:
        return {"object": "list", "data": [model_card(raw)]}

    def check_model(name: str | None) -> None:
        if name not in (None, "", config.served_model):
            raise APIError(404, f"model {name[:100]!r} does not exist; this server serves "
                                f"{config.served_model!r}", "not_found_error", "model")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request) -> dict:
        check_model(model_id or "?")
        return model_card(raw)

    async def run(jobs: list[Job], slots: Slots, body: Any, raw: Request, chat: bool
                  ) -> Response:
        rid = client.new_request_id("chatcmpl" if chat else "cmpl")
        logprobs = ((body.top_logprobs or 0) if body.logprobs else None) if chat \
            else body.logprobs
        if body.logprob_token_ids and logprobs is not None:  # every asked id is listed
            logprobs = len(body.logprob_token_ids) + 1
        plan = chat_plan(body, limits.tools) if chat and body.tools else None
        shape = Shape(chat, config.served_model, body.n, logprobs,
                      bool(body.return_tokens_as_token_ids), bool(body.return_token_ids),
                      config.block_size, config.enable_prefix_caching,
                      body.prompt_logprobs is not None,
                      plan if plan is not None and plan.choice != "none" else None)
        engine = client
        if body.use_beam_search:
            layout = getattr(client, "layout", None)
            if layout is not None and layout.has_prefill_pool:
                slots.release_all()
                raise APIError(400, "beam search is not supported with a prefill pool (P+D "
                               "layouts); use a colocated layout", param="use_beam_search")
            engine = BeamClient(client, processor, config.limits.max_model_len,
                                length_penalty=body.length_penalty,
                                early_stopping=body.early_stopping)
        gen = Generation(engine, rid, jobs, slots)
        responder = Responder(gen, Formatter(processor.tokenizer, shape, rid, int(time.time())),
                              metrics, raw, body.n)
        so = body.stream_options
        return await responder.respond(bool(body.stream), bool(so and so.include_usage),
                                       bool(so and so.continuous_usage_stats))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        jobs, slots = await stage.chat(body, tenant_of(raw.scope))
        return await run(jobs, slots, body, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        jobs, slots = await stage.completion(body, tenant_of(raw.scope))
        return await run(jobs, slots, body, raw, chat=False)

    from triptych.api.chat_batch import add_chat_batch_routes
    from triptych.api.responses import add_responses_routes
    from triptych.api.tokenize import add_tokenize_routes

    surface = config.surface
    add_tokenize_routes(app, stage, check_model, surface.tokenizer_info, validation_response)
    add_chat_batch_routes(app, stage, run, check_model, config.max_pending,
                          validation_response)
    add_responses_routes(app, client, stage, config.served_model, check_model,
                         surface.store_entries, surface.store_bytes, validation_response)

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        """SageMaker's entry point: a chat body (``messages``) or a completion (``prompt``)."""
        try:
            data = json.loads(await raw.body())
        except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
            raise APIError(400, "the request body is not valid JSON") from None
        kind = (ChatCompletionRequest if "messages" in data else
                CompletionRequest if "prompt" in data else None) if isinstance(data, dict) \
            else None
        if kind is None:
            raise APIError(400, "an invocation is a chat completion (with messages) or a "
                                "completion (with prompt)")
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            return validation_response(list(e.errors()), body_prefix=False)
        return await (chat(body, raw) if kind is ChatCompletionRequest
                      else completions(body, raw))

    return app


__all__ = ["AppConfig", "build_app", "field_path"]
