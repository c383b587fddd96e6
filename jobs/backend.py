"""Where a job's requests go: the server's own FastAPI app in this process, or a running
server at ``--server URL``.

Why the app and not the offline ``LLM``: a batch line is an HTTP request body, and its
answer must be what ``triptych serve`` would answer, error objects included. Driving the
same app (``api/server.py``: schema, checks, media, processor, Router, response format)
through httpx's ASGI transport gives exactly that with no second copy of the request
handling, and it makes the in-process mode and ``--server`` one code path that differs only
in the transport. The engine behind the app is serve's: the Router and its worker
processes for whatever layout the engine flags describe.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

RETRIES_ON_OVERLOAD = 8  # 429/503 + Retry-After (admission or bodies full): wait, send again


@dataclass
class Reply:
    """One HTTP answer: status, parsed JSON body (None if it was not JSON) and the server's
    ``x-request-id``."""

    status: int
    body: Any
    request_id: str | None


class Backend:
    """An OpenAI server reached through ``client`` (an httpx.AsyncClient)."""

    def __init__(self, client: httpx.AsyncClient, served_model: str) -> None:
        self.client, self.served_model = client, served_model

    async def post(self, path: str, body: dict[str, Any]) -> Reply:
        """POST ``body`` as JSON to ``path``; an overloaded server (429 or 503 with Retry-After) is
        waited for and asked again, a bounded number of times."""
        for attempt in range(RETRIES_ON_OVERLOAD + 1):
            r = await self.client.post(path, json=body)
            if r.status_code in (429, 503) and "retry-after" in r.headers \
                    and attempt < RETRIES_ON_OVERLOAD:
                await asyncio.sleep(min(float(r.headers["retry-after"] or 1), 5.0)
                                    * (attempt + 1))
                continue
            try:
                data = r.json()
            except ValueError:
                data = None
            return Reply(r.status_code, data, r.headers.get("x-request-id"))
        raise AssertionError("unreachable")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """``--server`` and ``--request-timeout``, plus every engine / layout flag of ``serve``
    (used when no ``--server`` is given)."""
    from triptych.cli import add_engine_args

    g = p.add_argument_group("where requests go")
    g.add_argument("--server", default=None, metavar="URL",
                   help="send the requests to this running triptych (or any OpenAI-compatible) "
                        "server, e.g. http://127.0.0.1:8000; unset: run serve's app and engine "
                        "in this process, configured by the engine flags below")
    g.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds one request may take (--server mode)")
    g.add_argument("--api-key", default=None,
                   help="with --server: sent as 'Authorization: Bearer <key>' (default: env "
                        "OPENAI_API_KEY, which keeps the key out of the process list; unset: "
                        "no key)")
    from triptych.api.surface_flags import add_surface_args

    add_surface_args(p)
    add_engine_args(p, model_required=False, model_help=(
        "checkpoint directory or Hugging Face hub id for the in-process engine (unset: the "
        "built-in demo checkpoint, as `triptych serve`); ignored with --server"))


def _serve_defaults() -> argparse.Namespace:
    """``triptych serve``'s defaults for every server-side limit (media caps, max n, ...),
    read from serve's own parser so the in-process app is configured as a default server."""
    from triptych.api import serve_cmd
    from triptych.cli import ArgumentParser

    parser = ArgumentParser(prog="triptych")
    serve_cmd.add_parser(parser.add_subparsers(dest="command", parser_class=ArgumentParser))
    return parser.parse_args(["serve"])


@contextlib.asynccontextmanager
async def _in_process(args: argparse.Namespace, max_pending: int) -> AsyncIterator[Backend]:
    from triptych.api.serve_cmd import app_and_router, served_model
    from triptych.cli import engine_config_from_args, resolve_model

    model, name = served_model(args, resolve_model(args.model) if args.model else None)
    config = engine_config_from_args(args, model=model)
    from triptych.api.surface_flags import FLAGS

    limits = _serve_defaults()
    for flag in FLAGS:  # the job's own tool / store flags
        setattr(limits, flag, getattr(args, flag))
    async with app_and_router(limits, config, model, name,
                              max_pending=max_pending) as (app, _):
        # raise_app_exceptions=False: the app answers its own failures with a 500 body, as
        # it would over a socket; the job records it for that line and goes on.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://in-process",
                                     timeout=None) as client:
            yield Backend(client, name)


@contextlib.asynccontextmanager
async def _remote(url: str, timeout: float, api_key: str | None) -> AsyncIterator[Backend]:
    from triptych.cli import fail

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                                 timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        try:
            r = await client.get("/v1/models")
        except httpx.HTTPError as e:
            fail(f"--server {url}: no OpenAI server answers GET /v1/models there "
                 f"({type(e).__name__})")
        if r.status_code in (401, 403):
            fail(f"--server {url}: the server refused the API key (HTTP {r.status_code}); "
                 + ("check --api-key or OPENAI_API_KEY" if api_key else
                    "it needs one: pass --api-key or set OPENAI_API_KEY"))
        try:
            r.raise_for_status()
            name = r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            fail(f"--server {url}: GET /v1/models answered HTTP {r.status_code}, not an "
                 f"OpenAI model list ({type(e).__name__})")
        yield Backend(client, name)


def open_backend(args: argparse.Namespace, max_pending: int
                 ) -> contextlib.AbstractAsyncContextManager[Backend]:
    """The backend the flags ask for. ``max_pending``: the in-process app's admission bound
    (engine requests at once; the job's own concurrency bound sits below it)."""
    if args.server:
        key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
        return _remote(args.server, args.request_timeout, key or None)
    return _in_process(args, max(256, max_pending))


__all__ = ["Backend", "Reply", "add_backend_args", "open_backend"]
