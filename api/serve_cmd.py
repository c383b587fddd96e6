"""`triptych serve`: the OpenAI-compatible server (README's main job)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

logger = logging.getLogger("triptych.api")


def add_parser(subparsers: Any) -> None:
    from triptych.cli import add_engine_args

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                    "/metrics. Without --model a tiny random demo checkpoint is built on first "
                    "use (outputs are gibberish; point --model at a real checkpoint directory).")
    add_engine_args(p, model_required=False)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; use 0.0.0.0 to expose deliberately)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the model directory's name)")
    p.add_argument("--max-pending-requests", type=int, default=256,
                   help="requests in flight beyond which new ones get 503 + Retry-After")
    p.add_argument("--max-request-bytes", type=int, default=64 << 20,
                   help="largest request body (data URLs included); bigger ones get 413")
    p.add_argument("--allowed-domains", default=None,
                   help="comma-separated hosts media URLs may come from (exact match); such hosts "
                        "may resolve to private addresses")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="let media URLs resolve to private/loopback addresses (unsafe on shared hosts)")
    p.add_argument("--max-image-pixels", type=int, default=32_000_000,
                   help="largest decoded image (width*height)")
    p.add_argument("--max-media-bytes", type=int, default=20 << 20,
                   help="largest encoded image or video, bytes")
    p.add_argument("--video-fps", type=float, default=2.0, help="frames sampled per video second")
    p.add_argument("--max-video-frames", type=int, default=16, help="frames kept per video")
    p.add_argument("--max-video-seconds", type=float, default=120.0,
                   help="longer videos are refused")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds to fetch one media URL")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from triptych.api.media import MediaLimits
    from triptych.api.processor import InputProcessor
    from triptych.api.server import build_app
    from triptych.cli import engine_config_from_args
    from triptych.models.demo import DEMO_FLAGS, tiny_checkpoint

    model = args.model
    if model is None:
        model = tiny_checkpoint("qwen2_vl", **DEMO_FLAGS)
        logger.info("no --model given: serving the tiny random demo checkpoint at %s", model)
    config = engine_config_from_args(args, model=model)
    limits = MediaLimits(
        max_image_bytes=args.max_media_bytes, max_video_bytes=args.max_media_bytes,
        max_image_pixels=args.max_image_pixels, video_fps=args.video_fps,
        max_video_frames=args.max_video_frames, max_video_seconds=args.max_video_seconds,
        fetch_timeout_s=args.media_fetch_timeout,
        allowed_domains=tuple(d.strip() for d in args.allowed_domains.split(","))
        if args.allowed_domains else None,
        allowed_local_media_path=config.allowed_local_media_path,
        allow_private_addresses=args.allow_private_media_urls)

    async def main() -> None:
        from transformers import AutoConfig
        from triptych.api.router import Router
        from triptych.engine.engine_core import resolve_max_model_len
        hf = AutoConfig.from_pretrained(model, local_files_only=True)
        max_len = resolve_max_model_len(
            config, getattr(hf, "text_config", hf).max_position_embeddings)
        processor = InputProcessor(model, limit_mm_per_prompt=config.limit_mm_per_prompt,
                                   media_limits=limits, max_model_len=max_len)
        client = Router(config, processor.tokenizer)
        try:
            await client.start()
            name = args.served_model_name or os.path.basename(os.path.normpath(model))
            app = build_app(client, processor, name, max_len, args.max_pending_requests,
                            args.max_request_bytes, on_shutdown=client.shutdown)
            server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                                   log_level="info", timeout_graceful_shutdown=2))
            logger.info("serving %s as %r on http://%s:%d", model, name, args.host, args.port)
            await server.serve()
        finally:  # (a no-op when the lifespan already stopped it)
            await client.shutdown()

    asyncio.run(main())
    return 0
