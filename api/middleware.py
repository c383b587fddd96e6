"""ASGI middleware of the HTTP server: request ids, the request-body cap and the bound on
request bodies held at once."""
from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import JSONResponse
from triptych.api.openai_format import error_body


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status,
                        headers=headers)


class RequestIdMiddleware:
    """Echo the client's x-request-id (or a fresh one) on every response. The id is a label
    for logs and clients only; the engine gets ids the server makes. Pure ASGI, so
    streaming responses still see client disconnects."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = given[:128] if given else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Refuse request bodies above ``max_bytes`` with 413 before anything parses them
    (uvicorn itself has no limit: a 10 GB data URL would be read into memory), and bound
    the bytes of bodies held at once, server-wide, by ``max_inflight_bytes``.

    A body counts from its first byte (its Content-Length, when sent, is reserved before
    any is read) until its request has been answered: the parsed body, its data URLs and
    decoded media live about as long. A body that does not fit gets 429 + Retry-After at
    once (clients of vLLM-style servers retry 429), so P0's memory for bodies stays under
    the bound however many clients send at once."""

    def __init__(self, app: Any, max_bytes: int, max_inflight_bytes: int | None = None
                 ) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.max_inflight = max_inflight_bytes or 4 * max_bytes
        self.inflight = 0  # bytes reserved by bodies in progress (one event loop: no lock)

    def _take(self, n: int) -> bool:
        if self.inflight + n > self.max_inflight:
            return False
        self.inflight += n
        return True

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(scope, receive, send)
        held = int(length) if length is not None else 0
        if not self._take(held):
            return await self._shed(scope, receive, send)
        try:
            await self._read_and_run(scope, receive, send, held)
        finally:
            self.inflight -= held

    async def _read_and_run(self, scope: dict, receive: Any, send: Any, held: int) -> None:
        # NOTE: ``held`` is the caller's reservation; chunks beyond it (no Content-Length,
        # or a client sending more than it said) are reserved as they arrive.
        body, more = [], True
        size = extra = 0
        try:
            while more:
                msg = await receive()
                if msg["type"] != "http.request":  # gone before the body arrived
                    return
                body.append(msg.get("body", b""))
                size += len(body[-1])
                more = msg.get("more_body", False)
                if size > self.max_bytes:
                    return await self._refuse(scope, receive, send)
                if size > held + extra:
                    if not self._take(size - held - extra):
                        body.clear()
                        return await self._shed(scope, receive, send, more)
                    extra = size - held
            replayed = False

            async def replay() -> dict:  # the whole body once, then the real channel
                nonlocal replayed
                if not replayed:
                    replayed = True
                    data = b"".join(body)
                    body.clear()  # the app holds the body from here on, not us as well
                    return {"type": "http.request", "body": data, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
        finally:
            self.inflight -= extra

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        resp = error_response(413, f"request body is larger than {self.max_bytes} bytes",
                              "invalid_request_error")
        await resp(scope, receive, send)

    async def _shed(self, scope: dict, receive: Any, send: Any, more: bool = True) -> None:
        # Read the rest of the body and drop it, chunk by chunk (nothing is kept): a client
        # still sending when the answer comes would see a reset connection, not the 429.
        seen = 0
        while more and seen <= self.max_bytes:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            more = msg.get("more_body", False)
        resp = error_response(429, "the server is holding too many request bodies; retry "
                                   "shortly (--max-inflight-body-bytes)", "rate_limit_error",
                              headers={"Retry-After": "1"})
        await resp(scope, receive, send)
