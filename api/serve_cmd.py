"""`triptych serve`: the OpenAI-compatible server (README's main job).

Every bound on what one request may cost is a flag here with its default in ``--help``, and
a refusal names the flag. ``--model`` is checked before any process starts.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger("triptych.api")


def add_parser(subparsers: Any) -> None:
    from triptych.api.media.flags import add_media_args
    from triptych.cli import add_engine_args

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /invocations, "
                    "/health, /version and /metrics. Without --model the built-in "
                    "demo checkpoint is served: a tiny model trained to transcribe printed "
                    "lines and short pages (point --model at a real checkpoint).")
    add_engine_args(p, model_required=False)
    from triptych.api.surface_flags import add_surface_args

    add_surface_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (use 0.0.0.0 to expose the server deliberately)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--served-model-name", default=None,
                   help="model name clients send (if unset: the model directory's name, or "
                        "the hub id)")
    t = p.add_argument_group("API keys and tenants")
    t.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer <key>' (default: env "
                        "VLLM_API_KEY; unset: no key needed); /health, /ping, /version and "
                        "(unless --protect-metrics) /metrics stay open")
    t.add_argument("--api-keys-file", default=None,
                   help="file of 'KEY TENANT' lines (# comments; mode 600, owned by this "
                        "user): each tenant's uuids and prefix cache are its own")
    t.add_argument("--protect-metrics", action="store_true",
                   help="/metrics needs an API key too")
    t.add_argument("--admin-api-key-file", default=None,
                   help="file holding the operator's key (one line; mode 600, owned by this "
                        "user): it alone opens /admin/* (pool resizing) and /health's "
                        "detail, and is no tenant's key (default: none, admin endpoints "
                        "off)")
    t.add_argument("--admin-api-key", default=None,
                   help="the operator's key on the command line (SGLang's flag; other local "
                        "users can read a command line: prefer --admin-api-key-file)")
    lim = p.add_argument_group("limits (each refusal names its flag)")
    lim.add_argument("--max-pending-requests", type=int, default=256,
                     help="engine sequences in flight (a request holds n per prompt) beyond "
                          "which new requests get 429 + Retry-After (also the most prompts "
                          "one /v1/completions request may hold)")
    lim.add_argument("--max-pending-share", type=float, default=0.5,
                     help="most of --max-pending-requests one tenant holds at once, when "
                          "--api-keys-file names several tenants (a tenant holding none is "
                          "always let in); beyond it 429")
    lim.add_argument("--max-request-bytes", type=int, default=64 << 20,
                     help="largest request body, data URLs included; bigger ones get 413")
    lim.add_argument("--max-request-values", type=int, default=1 << 20,
                     help="most JSON values (counted as commas, as the body arrives) in a "
                          "request body; more get 413 before the body is parsed (token-id "
                          "prompts, logit_bias and whitelists of a real vocabulary fit)")
    lim.add_argument("--max-inflight-body-bytes", type=int, default=0,
                     help="bytes of request bodies held at once, server-wide (a body counts "
                          "until its request is answered); beyond it 429 + Retry-After "
                          "(0: 4 x --max-request-bytes)")
    lim.add_argument("--request-body-timeout", type=float, default=30.0,
                     help="seconds a request body has to arrive, extended by a second per "
                          "--request-body-min-rate bytes received; a slower body gets 408")
    lim.add_argument("--request-body-min-rate", type=int, default=64 << 10,
                     help="bytes/s a request body must keep up past --request-body-timeout "
                          "(0: the timeout alone bounds it)")
    lim.add_argument("--max-body-share", type=float, default=0.5,
                     help="most of --max-inflight-body-bytes one client address, and one "
                          "tenant, may hold at once (never less than one --max-request-bytes "
                          "body); beyond it 429")
    lim.add_argument("--limit-concurrency", type=int, default=1024,
                     help="uvicorn's limit_concurrency: open connections + tasks beyond "
                          "which uvicorn answers 503 before reading anything (idle "
                          "connections are capped below it: --max-idle-connections)")
    lim.add_argument("--http-header-timeout", type=float, default=10.0,
                     help="seconds a connection has to send a request's headers, from its "
                          "opening or the end of its previous response; else it is closed")
    lim.add_argument("--max-idle-connections", type=int, default=512,
                     help="connections with no request in progress beyond which the oldest "
                          "idle one is closed, so a new client always gets in")
    lim.add_argument("--max-idle-connections-per-client", type=int, default=128,
                     help="the same, per client address (its own oldest idle connection is "
                          "closed first)")
    lim.add_argument("--max-prompt-chars", type=int, default=0,
                     help="most characters of text in one request, checked before "
                          "tokenization (0: 20 x max_model_len)")
    lim.add_argument("--max-n", type=int, default=16,
                     help="most completions per prompt (n, best_of)")
    g = p.add_argument_group("structured output (P0's compile check)")
    g.add_argument("--max-structured-depth", type=int, default=64,
                   help="deepest JSON nesting of a schema or structural tag; deeper is a 400")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds one compile may take (time queued not counted); its "
                        "process is killed and the request gets a 400")
    g.add_argument("--grammar-compile-procs", type=int, default=2,
                   help="compile processes (~270 MB each, started on first use); a tenant "
                        "runs at most all but one of them at once")
    add_media_args(p)


def run(args: argparse.Namespace) -> int:
    from triptych.api.media.flags import video_caps
    from triptych.cli import engine_config_from_args, fail, resolve_model

    # Everything the command line can get wrong fails here, in one line, before any
    # process starts or any weight is read.
    model = resolve_model(args.model) if args.model else None
    video_caps(args)  # bad video caps fail here, before any process starts
    for flag in ("max_pending_requests", "max_request_bytes", "max_n", "max_image_pixels",
                 "max_video_pixels", "max_request_pixels", "max_media_bytes",
                 "max_concurrent_media_fetches", "limit_concurrency", "media_dns_threads",
                 "media_dns_per_domain", "max_structured_depth", "grammar_compile_procs",
                 "max_idle_connections", "max_idle_connections_per_client",
                 "max_request_values"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1")
    if not args.request_body_timeout > 0 or args.request_body_min_rate < 0 or \
            not 0 < args.max_body_share <= 1 or not 0 < args.max_pending_share <= 1:
        fail("--request-body-timeout must be > 0, --request-body-min-rate >= 0, and "
             "--max-body-share and --max-pending-share in (0, 1]")
    if not args.http_header_timeout > 0 or not args.max_image_decode_seconds > 0 or \
            not args.mm_processor_memory > 0 or args.mm_processor_workers < -1:
        fail("--http-header-timeout, --max-image-decode-seconds and --mm-processor-memory "
             "must be > 0, --mm-processor-workers >= 0 (-1: the default)")
    if args.max_idle_connections >= args.limit_concurrency:
        fail("--max-idle-connections must be below --limit-concurrency (idle connections "
             "would fill it and every new request would get 503)")
    if args.max_prompt_chars < 0 or not args.media_fetch_timeout > 0 or \
            not args.max_video_decode_seconds > 0 or not args.grammar_compile_timeout > 0:
        fail("--max-prompt-chars must be >= 0, --media-fetch-timeout, "
             "--max-video-decode-seconds and --grammar-compile-timeout > 0")
    if 0 < args.max_inflight_body_bytes < args.max_request_bytes or \
            args.max_inflight_body_bytes < 0:
        fail("--max-inflight-body-bytes must be 0 or at least --max-request-bytes")
    tenants = _tenants(args)
    from triptych.api.surface_flags import surface_config

    surface_config(args)  # bad tool / store flags fail here
    model, name = served_model(args, model)
    config = engine_config_from_args(args, model=model)
    from triptych.router.errors import ClusterError

    try:
        asyncio.run(_serve(args, config, model, name, tenants))
    except ClusterError as e:  # Ray unreachable, or short of what the pools ask: one line
        fail(str(e))
    except KeyboardInterrupt:
        # NOTE: uvicorn re-raises the SIGINT it handled once it has shut down cleanly;
        # asyncio.run turns that into CancelledError + KeyboardInterrupt. Ctrl-C is how a
        # terminal user stops the server: no traceback (the finally in _serve has run).
        logger.info("stopped (Ctrl-C)")
    return 0


def _tenants(args: argparse.Namespace) -> Any:
    from triptych.api.tenancy import (
        KeyFileError,
        Tenants,
        read_admin_key_file,
        read_keys_file,
    )
    from triptych.cli import fail

    key = args.api_key if args.api_key is not None else os.environ.get("VLLM_API_KEY")
    try:
        keys = read_keys_file(args.api_keys_file) if args.api_keys_file else {}
    except KeyFileError as e:
        fail(str(e))
    if key is not None and key in keys:
        fail("--api-key is also listed in --api-keys-file (one key, one tenant)")
    if args.protect_metrics and not (key or keys):
        fail("--protect-metrics needs --api-key or --api-keys-file")
    admin = getattr(args, "admin_api_key", None)
    if getattr(args, "admin_api_key_file", None):
        if admin is not None:
            fail("give --admin-api-key or --admin-api-key-file, not both")
        try:
            admin = read_admin_key_file(args.admin_api_key_file)
        except KeyFileError as e:
            fail(str(e))
    if admin is not None and (not admin.strip() or admin == key or admin in keys):
        fail("the admin key must be non-empty and no tenant's key (--api-key, "
             "--api-keys-file): admin is not a tenant")
    return Tenants([key] if key else [], keys, admin_key=admin)


def served_model(args: argparse.Namespace, model: str | None) -> tuple[str, str]:
    """(checkpoint directory, served name): the resolved ``--model``, or the built-in demo
    checkpoint (a tiny model trained to transcribe printed text) when none was given."""
    if model is None:
        from triptych.models.demo import demo_checkpoint
        model = demo_checkpoint()
        logger.info("no --model given: serving the built-in demo checkpoint at %s (a tiny "
                    "OCR model: it transcribes printed lines and short pages and answers "
                    "every prompt that way, see docs/demo-model.md; pass --model for a "
                    "real one)", model)
    name = getattr(args, "served_model_name", None) or (
        args.model if args.model and not os.path.isdir(os.path.expanduser(args.model))
        else os.path.basename(os.path.normpath(model)))
    return model, name


@contextlib.asynccontextmanager
async def app_and_router(limits: argparse.Namespace, config: Any, model: str, name: str,
                         tenants: Any = None, max_pending: int | None = None
                         ) -> AsyncIterator[tuple[Any, Any]]:
    """serve's FastAPI app over a started Router, configured from ``limits`` (a namespace
    with every server-side flag of ``triptych serve``: media caps, body and admission
    bounds, ...). ``triptych serve`` puts uvicorn in front of it; the batch jobs drive it
    in-process. The router stops when the block ends."""
    from transformers import AutoConfig
    from triptych.api.media.flags import media_limits_from_args, prep_workers
    from triptych.api.processor import InputProcessor
    from triptych.api.request_checks import ServerLimits
    from triptych.api.server import AppConfig, build_app
    from triptych.api.surface_flags import surface_config
    from triptych.api.template_cost import TemplateCost
    from triptych.engine.engine_core import resolve_max_model_len
    from triptych.mmcache import ProcessorCacheIndex, processor_cache_bytes
    from triptych.router.router import Router

    surface = surface_config(limits)
    max_pending = max_pending or limits.max_pending_requests
    hf = AutoConfig.from_pretrained(model, local_files_only=True)
    text = getattr(hf, "text_config", hf)
    max_len = resolve_max_model_len(config, text.max_position_embeddings)
    media = media_limits_from_args(limits, config.allowed_local_media_path)
    cache_bytes = processor_cache_bytes(config.mm_processor_cache_gb)
    processor = InputProcessor(model, limit_mm_per_prompt=config.limit_mm_per_prompt,
                               media_limits=media, max_model_len=max_len,
                               cache=ProcessorCacheIndex(cache_bytes) if cache_bytes else None,
                               mm_preprocessor=config.mm_preprocessor)
    checks = ServerLimits(max_model_len=max_len, vocab_size=text.vocab_size,
                          max_n=limits.max_n, max_prompt_chars=limits.max_prompt_chars,
                          max_prompts=max_pending,
                          limit_mm_per_prompt=dict(config.limit_mm_per_prompt), media=media,
                          max_structured_depth=limits.max_structured_depth,
                          grammar_compile_timeout_s=limits.grammar_compile_timeout,
                          grammar_compile_procs=limits.grammar_compile_procs,
                          template=TemplateCost.of_tokenizer(processor.tokenizer),
                          tools=surface.tools)
    cache_info = {"block_size": str(config.block_size),
                  "enable_prefix_caching": str(config.enable_prefix_caching),
                  "num_gpu_blocks_override": str(config.num_kv_blocks),
                  "gpu_memory_utilization": str(config.gpu_memory_utilization),
                  "kv_cache_memory": str(config.kv_cache_memory), "cache_dtype": "auto"}
    app_config = AppConfig(
        served_model=name, limits=checks, model_root=limits.model or model,
        max_pending=max_pending, pending_share=limits.max_pending_share,
        max_body_bytes=limits.max_request_bytes, max_body_values=limits.max_request_values,
        max_inflight_body_bytes=limits.max_inflight_body_bytes or 4 * limits.max_request_bytes,
        body_timeout_s=limits.request_body_timeout, body_min_rate=limits.request_body_min_rate,
        body_share=limits.max_body_share,
        max_media_fetches=limits.max_concurrent_media_fetches, block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching, cache_info=cache_info,
        protect_metrics=limits.protect_metrics, surface=surface,
        **({"tenants": tenants} if tenants is not None else {}))  # none given: an open app
    if config.mm_preprocessor == "fast":  # build (once per machine) or load the resize
        from triptych.models import image_ops  # kernel now, not on the first image

        image_ops.load_resize()
    workers = prep_workers(limits.mm_processor_workers, config.device)
    if workers:
        from triptych.api.prep_pool import PrepPool

        processor.prep = PrepPool(model, workers, limits.max_image_decode_seconds,
                                  int(limits.mm_processor_memory * (1 << 30)),
                                  {"mm_preprocessor": config.mm_preprocessor})
    router = Router(config, processor.tokenizer, processor=processor)
    try:
        await router.start()  # (the preparation processes start at the first image)
        yield build_app(router, processor, app_config, on_shutdown=router.shutdown), router
    finally:  # (a no-op when the lifespan already stopped it)
        await router.shutdown()
        if processor.prep is not None:
            await asyncio.to_thread(processor.prep.close)


async def _serve(args: argparse.Namespace, config: Any, model: str, name: str,
                 tenants: Any) -> None:
    import uvicorn
    from triptych.api.connections import ConnectionGuard, guarded_protocol

    guard = ConnectionGuard(args.http_header_timeout, args.max_idle_connections,
                            args.max_idle_connections_per_client)
    async with app_and_router(args, config, model, name, tenants) as (app, _):
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level="info", timeout_graceful_shutdown=2,
                                               limit_concurrency=args.limit_concurrency,
                                               http=guarded_protocol(guard)))
        logger.info("serving %s as %r on http://%s:%d", model, name, args.host, args.port)
        # NOTE: as vLLM's server does: what start-up made (tokenizer, processor, modules)
        # lives as long as the server, so full collections need not walk it again; under
        # load they otherwise stalled this loop ~0.75 s each (measured).
        gc.collect()
        gc.freeze()
        await server.serve()
