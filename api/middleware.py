"""ASGI middleware of the HTTP server: request ids and the request-body cap."""
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
    (uvicorn itself has no limit: a 10 GB data URL would be read into memory)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(scope, receive, send)
        body, more = [], True
        size = 0
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # gone before the body arrived
                return
            body.append(msg.get("body", b""))
            size += len(body[-1])
            more = msg.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
        replayed = False

        async def replay() -> dict:  # the whole body once, then the real channel (disconnects)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        resp = error_response(413, f"request body is larger than {self.max_bytes} bytes",
                              "invalid_request_error")
        await resp(scope, receive, send)
