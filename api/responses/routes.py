"""POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

    body -> ResponsesRequest -> (previous response's conversation) + input -> chat body
         -> the chat path's checks, admission, media and processor (InputStage.chat)
         -> one engine request -> a response object, or its events (api/responses/events.py)

``store`` (default true) keeps the response for GET and ``previous_response_id``
(api/responses/store.py, per tenant); ``background`` (needs store) answers "queued" at
once and runs on, to be fetched or cancelled by id.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from triptych.api.errors import APIError, bad_request
from triptych.api.openai_format import Formatter, Shape
from triptych.api.protocol import ChatCompletionRequest
from triptych.api.responses.convert import chat_fields, input_messages
from triptych.api.responses.events import EventStream
from triptych.api.responses.format import (
    Outcome,
    chat_logprobs_to_output,
    new_id,
    output_items,
    response_object,
    status_of,
)
from triptych.api.responses.protocol import ResponsesRequest
from triptych.api.responses.store import Entry, ResponseStore
from triptych.api.serving import ClientGone, Generation, _refusal, _watch
from triptych.api.tenancy import tenant_of
from triptych.api.tools.checks import chat_plan
from triptych.api.tools.reader import ToolReader

logger = logging.getLogger("triptych.api")


def items_to_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant turn a later request continues from."""
    text = "".join(p.get("text", "") for it in items if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


class Run:
    """One response's generation: its chat body, engine jobs and how to read the text."""

    def __init__(self, ctx: Any, req: ResponsesRequest, chat: ChatCompletionRequest,
                 rid: str, created: int) -> None:
        self.ctx, self.req, self.chat, self.rid, self.created = ctx, req, chat, rid, created
        plan = chat_plan(chat, ctx.limits.tools) if chat.tools else None
        self.plan = plan if plan is not None and plan.choice != "none" else None
        k = (chat.top_logprobs or 0) if chat.logprobs else None
        self.fmt = Formatter(ctx.tokenizer, Shape(True, ctx.model, 1, k), rid, created)
        self.jobs: list[Any] = []
        self.slots: Any = None

    async def prepare(self, tenant: str | None) -> None:
        self.jobs, self.slots = await self.ctx.stage.chat(self.chat, tenant)

    async def deltas(self, gen: Generation, outcome: Outcome) -> AsyncIterator[Any]:
        """The engine's completion deltas, recorded into ``outcome`` as they pass."""
        await gen.start(self.req.stream)  # a whole response: its text decoded once
        finished = False
        while not finished:
            _, d = await gen.next()
            if isinstance(d, Exception):
                raise d
            outcome.prompt_tokens, outcome.cached_tokens = d.num_prompt_tokens, \
                d.num_cached_tokens
            for c in d.completions:
                outcome.text += c.text
                outcome.token_ids += c.token_ids
                if self.chat.logprobs:  # (extended in place: a copy per delta is quadratic)
                    outcome.logprobs = outcome.logprobs if outcome.logprobs is not None else []
                    outcome.logprobs += self.logprobs(c)
                outcome.finish_reason = c.finish_reason or outcome.finish_reason
                yield c
            finished = d.finished

    def logprobs(self, c: Any) -> list[Any]:
        if not c.token_ids:
            return []
        return chat_logprobs_to_output(self.fmt.chat_logprobs(c.token_ids,
                                                              c.logprobs or [])["content"])

    def finish(self, outcome: Outcome, ids: dict[str, str] | None = None) -> dict[str, Any]:
        if self.plan is not None:
            outcome.message, _ = ToolReader(self.plan).message(outcome.text,
                                                               outcome.finish_reason)
        items = output_items(outcome, ids)
        return response_object(self.rid, self.req, self.ctx.model, self.created,
                               status_of(outcome.finish_reason), items, outcome)

    def generation(self) -> Generation:
        return Generation(self.ctx.client, self.rid, self.jobs, self.slots)


class _Ctx:
    def __init__(self, client: Any, stage: Any, model: str) -> None:
        self.client, self.stage, self.model = client, stage, model
        self.limits, self.tokenizer = stage.limits, stage.processor.tokenizer


def add_responses_routes(app: FastAPI, client: Any, stage: Any, model: str, check_model: Any,
                         store_entries: int, store_bytes: int, validation_response: Any
                         ) -> None:
    """The routes over the server's engine client, InputStage and served name;
    ``check_model``, ``validation_response``: the server's (api/server.py)."""
    ctx = _Ctx(client, stage, model)
    store = ResponseStore(store_entries, store_bytes)

    def keep(tenant: str | None, rid: str, entry: Entry) -> None:
        if not store.put(tenant, rid, entry):
            logger.info("response %s not stored: larger than --responses-store-bytes", rid)

    @app.post("/v1/responses")
    async def create(raw: Request) -> Response:
        try:
            req = ResponsesRequest.model_validate(await raw.json())
        except ValueError as e:
            if isinstance(e, ValidationError):
                return validation_response(list(e.errors()), body_prefix=False)
            raise APIError(400, "the request body is not valid JSON") from None
        check_model(req.model)
        if req.background and not req.store:
            raise bad_request("background", "background can only be used when `store` is "
                                            "true")
        if req.background and req.stream:
            raise bad_request("background", "background responses cannot be streamed here; "
                                            "fetch them by id")
        tenant = tenant_of(raw.scope)
        earlier: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = store.get(tenant, req.previous_response_id)
            if prev is None:
                raise store.not_found(req.previous_response_id)
            if prev.running:
                raise bad_request("previous_response_id", "the previous response is still "
                                                          "running")
            earlier = prev.conversation
        turn = input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            chat = ChatCompletionRequest.model_validate(
                chat_fields(req, system + earlier + turn))
        except ValidationError as e:
            return validation_response(list(e.errors()), body_prefix=False)
        run = Run(ctx, req, chat, new_id("resp"), int(time.time()))
        await run.prepare(tenant)
        conversation = earlier + turn
        if req.background:
            entry = Entry(response_object(run.rid, req, model, run.created, "queued"),
                          conversation, background=True)
            try:
                keep(tenant, run.rid, entry)
            except APIError:
                run.slots.release_all()
                raise
            entry.task = asyncio.ensure_future(_background(run, entry, tenant))
            return JSONResponse(entry.response)
        if req.stream:
            return StreamingResponse(_stream(run, tenant, conversation),
                                     media_type="text/event-stream")
        gen = run.generation()
        watch = asyncio.ensure_future(_watch(raw, gen))
        outcome = Outcome()
        try:
            async for _ in run.deltas(gen, outcome):
                pass
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine refused or failed
            raise _refusal(e) from None
        finally:
            watch.cancel()
            await gen.aclose()
        response = run.finish(outcome)
        if req.store:
            keep(tenant, run.rid, Entry(response, conversation + [items_to_message(
                response["output"])]))
        return JSONResponse(response)

    async def _stream(run: Run, tenant: str | None, conversation: list[dict[str, Any]]
                      ) -> AsyncIterator[str]:
        ev, outcome = EventStream(), Outcome()
        reader = ToolReader(run.plan) if run.plan is not None else None
        yield ev.event("response.created", response=response_object(
            run.rid, run.req, model, run.created, "in_progress"))
        yield ev.event("response.in_progress", response=response_object(
            run.rid, run.req, model, run.created, "in_progress"))
        gen = run.generation()
        pending: list[Any] = []  # logprobs of tokens whose text is held back
        try:
            async for c in run.deltas(gen, outcome):
                if reader is None:
                    pending += run.logprobs(c) if run.chat.logprobs else []
                    if c.text:
                        for chunk in ev.text_delta(c.text, pending):
                            yield chunk
                        pending = []
                    continue
                delta = reader.deltas(outcome.text, c.finish_reason is not None)
                if delta.get("content"):
                    for chunk in ev.text_delta(delta["content"], []):
                        yield chunk
                for tc in delta.get("tool_calls", []):
                    for chunk in ev.call_delta(tc):
                        yield chunk
        except Exception as e:  # noqa: BLE001 - failed mid-way: say so and end
            err = e if isinstance(e, APIError) else _refusal(e)
            failed = response_object(run.rid, run.req, model, run.created, "failed")
            failed["error"] = {"code": "server_error", "message": err.message}
            yield ev.event("response.failed", response=failed)
            return
        finally:
            await gen.aclose()
        if pending:
            for chunk in ev.text_delta("", pending):
                yield chunk
        for chunk in ev.close():
            yield chunk
        response = run.finish(outcome, ev.ids)
        if run.req.store:
            keep(tenant, run.rid, Entry(response, conversation + [items_to_message(
                response["output"])]))
        kind = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        yield ev.event(kind, response=response)

    async def _background(run: Run, entry: Entry, tenant: str | None) -> None:
        entry.response = {**entry.response, "status": "in_progress"}
        gen = run.generation()
        outcome = Outcome()
        try:
            async for _ in run.deltas(gen, outcome):
                pass
            entry.response = run.finish(outcome)
            entry.conversation = entry.conversation + [items_to_message(
                entry.response["output"])]
        except asyncio.CancelledError:
            entry.response = {**entry.response, "status": "cancelled"}
        except Exception as e:  # noqa: BLE001 - recorded on the response
            err = e if isinstance(e, APIError) else _refusal(e)
            entry.response = {**entry.response, "status": "failed",
                              "error": {"code": "server_error", "message": err.message}}
        finally:
            await gen.aclose()
            entry.task = None
            keep(tenant, run.rid, entry)

    def lookup(raw: Request, rid: str) -> Entry:
        entry = store.get(tenant_of(raw.scope), rid)
        if entry is None:
            raise store.not_found(rid)
        return entry

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, raw: Request) -> JSONResponse:
        return JSONResponse(lookup(raw, rid).response)

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, raw: Request) -> JSONResponse:
        entry = lookup(raw, rid)
        if entry.task is not None:
            entry.task.cancel()
        store.delete(tenant_of(raw.scope), rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str, raw: Request) -> JSONResponse:
        entry = lookup(raw, rid)
        if not entry.background:
            raise bad_request("response_id", "Cannot cancel a synchronous response.")
        task = entry.task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(entry.response)


__all__ = ["add_responses_routes", "items_to_message"]
