"""ASGI middleware of the HTTP server: request ids, the request-body cap and the bound on
request bodies held at once."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
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


NO_BODY_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})  # read no body


class _Holder:
    """What one body holds of the budget, charged to the server, its client address and
    (on a keyed server) its tenant as its bytes arrive."""

    def __init__(self, limit: BodyLimitMiddleware, client: str, tenant: tuple | None) -> None:
        self.limit, self.client, self.tenant, self.held = limit, client, tenant, 0

    def take(self, n: int) -> bool:
        lim = self.limit
        if lim.inflight + n > lim.max_inflight or \
                lim.by_client.get(self.client, 0) + n > lim.share or \
                (self.tenant is not None and lim.by_tenant.get(self.tenant, 0) + n > lim.share):
            return False
        self._add(n)
        return True

    def release(self) -> None:
        self._add(-self.held)

    def _add(self, n: int) -> None:
        lim = self.limit
        self.held += n
        lim.inflight += n
        for book, key in ((lim.by_client, self.client), (lim.by_tenant, self.tenant)):
            if key is not None:
                book[key] = book.get(key, 0) + n
                if not book[key]:
                    del book[key]


class BodyLimitMiddleware:
    """Refuse request bodies above ``max_bytes`` with 413 before anything parses them
    (uvicorn itself has no limit: a 10 GB data URL would be read into memory), and bound
    the bytes of bodies held at once by ``max_inflight_bytes``.

    Bytes are budgeted as they arrive: a declared Content-Length reserves nothing, so idle
    sockets that announce 64 MiB and send nothing hold nothing. A body held counts until its
    request has been answered (the parsed body, its data URLs and decoded media live about
    as long). One client address, and on a keyed server one tenant, may hold at most
    ``share`` of the budget (never less than one ``max_bytes`` body); a body that does not
    fit gets 429 + Retry-After (clients of vLLM-style servers retry 429). A body must arrive
    within ``timeout_s`` plus one second per ``min_rate`` bytes received (Apache's
    mod_reqtimeout rule), else 408 and the connection is closed. A body with more than
    ``max_values`` commas (JSON values, counted as the bytes arrive: prose has about one per
    60 characters, base64 none) gets 413 before it is parsed: parsing 3 M small values
    holds P0's event loop ~0.2 s, and everyone's requests with it. ``prechecks``: path ->
    a check of the whole body before the app parses it (an error message: 400), e.g. the
    validation pass's message bound on a chat body (api/template_cost.py ``raw_bound``)."""

    def __init__(self, app: Any, max_bytes: int, max_inflight_bytes: int | None = None,
                 timeout_s: float = 30.0, min_rate: int = 64 << 10, share: float = 0.5,
                 max_values: int = 1 << 20,
                 prechecks: dict[str, Callable[[bytes], str | None]] | None = None) -> None:
        self.app, self.max_bytes, self.max_values = app, max_bytes, max_values
        self.prechecks = prechecks or {}
        self.max_inflight = max_inflight_bytes or 4 * max_bytes
        self.timeout_s, self.min_rate = timeout_s, min_rate
        self.share = max(int(share * self.max_inflight), max_bytes)
        # (one event loop: no lock)
        self.inflight = 0  # bytes held by bodies in progress or not yet answered
        self.by_client: dict[str, int] = {}
        self.by_tenant: dict[tuple, int] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or \
                scope["path"] in NO_BODY_PATHS:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._answer(scope, receive, send, 413)
        state = scope.get("state") or {}
        holder = _Holder(self, (scope.get("client") or ("?",))[0],
                         (state["tenant"],) if "tenant" in state else None)
        try:
            await self._read_and_run(scope, receive, send, holder)
        finally:
            holder.release()

    async def _read_and_run(self, scope: dict, receive: Any, send: Any, holder: _Holder
                            ) -> None:
        body: list[bytes] = []
        deadline = time.monotonic() + self.timeout_s
        size, values, more, status, too_many = 0, 0, True, 0, False
        while more:
            msg = await self._receive(receive, deadline + size / self.min_rate
                                      if self.min_rate else deadline)
            if msg is None:
                return await self._answer(scope, receive, send, 408)
            if msg["type"] != "http.request":  # gone before the body arrived
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > self.max_bytes:
                return await self._answer(scope, receive, send, 413)
            if status:
                continue  # refused: read to the end and drop (the client sees the answer;
                # nothing counted: 18 MB of a 26 MB body arrive after the refusal)
            values += chunk.count(b",")
            if values > self.max_values:  # (read to the end, then answered)
                status, too_many = 413, True
                body.clear()
                holder.release()
                continue
            if holder.take(len(chunk)):
                body.append(chunk)
            else:
                status = 429
                body.clear()
                holder.release()
        if status:
            return await self._answer(scope, receive, send, status, too_many)
        check = self.prechecks.get(scope["path"])
        if check is not None:
            body[:] = [b"".join(body)]
            message = check(body[0])
            if message is not None:
                body.clear()
                resp = error_response(400, message, "invalid_request_error", "messages")
                return await resp(scope, receive, send)
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

    @staticmethod
    async def _receive(receive: Any, deadline: float) -> dict | None:
        """The next ASGI message, or None when ``deadline`` passes first."""
        try:
            return await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None

    async def _answer(self, scope: dict, receive: Any, send: Any, status: int,
                      too_many: bool = False) -> None:
        if too_many:
            resp = error_response(413, f"request body holds more than {self.max_values} JSON "
                                       f"values (--max-request-values)", "invalid_request_error")
        elif status == 413:
            resp = error_response(413, f"request body is larger than {self.max_bytes} bytes",
                                  "invalid_request_error")
        elif status == 408:  # the rest of the body is not waited for: close the connection
            resp = error_response(408, "the request body did not arrive in time "
                                       f"(--request-body-timeout {self.timeout_s:g} s, then "
                                       f"--request-body-min-rate {self.min_rate} bytes/s)",
                                  "invalid_request_error", headers={"Connection": "close"})
        else:
            resp = error_response(429, "the server is holding too many request bodies (or "
                                       "too many of yours); retry shortly "
                                       "(--max-inflight-body-bytes, --max-body-share)",
                                  "rate_limit_error", headers={"Retry-After": "1"})
        await resp(scope, receive, send)
