"""vLLM's POST /v1/chat/completions/batch: several conversations in one body, one answer.

    {"messages": [[conversation 0], [conversation 1], ...], <chat fields shared by all>}
      -> one chat.completion whose choices are indexed conversation by conversation
         (index = conversation * n + completion), usage summed

Each conversation goes through the chat path as its own request (checks, media, template,
one engine request each, all in flight together); any refusal refuses the whole batch
before an engine request is sent. Streaming is not offered, as in vLLM.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from triptych.api.errors import APIError, bad_request
from triptych.api.protocol import ChatCompletionRequest
from triptych.api.tenancy import tenant_of


class _AllSlots:
    """The admission slots of every conversation, released as one request's are."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    @property
    def held(self) -> int:
        return sum(p.held for p in self.parts)

    def release(self, k: int = 1) -> None:
        for p in self.parts:
            take = min(k, p.held)
            p.release(take)
            k -= take
            if not k:
                return

    def release_all(self) -> None:
        for p in self.parts:
            p.release_all()


def add_chat_batch_routes(app: FastAPI, stage: Any, run: Any, check_model: Any,
                          max_conversations: int, validation_response: Any) -> None:
    """``run(jobs, slots, body, raw, chat=True)``: the server's responder for chat jobs;
    ``check_model``, ``validation_response``: the server's (api/server.py)."""
    @app.post("/v1/chat/completions/batch")
    async def batch(raw: Request) -> Response:
        try:
            data = await raw.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        convs = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(convs, list) or not convs or \
                not all(isinstance(c, list) for c in convs):
            raise bad_request("messages", "messages must be a non-empty list of "
                                          "conversations (each a list of messages)")
        if len(convs) > max_conversations:
            raise bad_request("messages", f"{len(convs)} conversations; at most "
                                          f"{max_conversations} (--max-pending-requests)")
        if data.get("stream"):
            raise bad_request("stream", "streaming is not supported for batched chat "
                                        "completions")
        bodies = []
        for conv in convs:
            try:
                bodies.append(ChatCompletionRequest.model_validate({**data, "messages": conv}))
            except ValidationError as e:
                return validation_response(list(e.errors()), body_prefix=False)
        check_model(bodies[0].model)
        tenant = tenant_of(raw.scope)
        jobs: list[Any] = []
        slots: list[Any] = []
        try:
            for body in bodies:
                j, s = await stage.chat(body, tenant)
                jobs += j
                slots.append(s)
        except BaseException:
            for s in slots:
                s.release_all()
            raise
        return await run(jobs, _AllSlots(slots), bodies[0], raw, chat=True)


__all__ = ["add_chat_batch_routes"]
