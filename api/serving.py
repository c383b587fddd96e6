"""Running the engine requests of one HTTP request and writing the answer.

    jobs (one per prompt) -> Generation: submit each, merge their deltas
                          -> whole JSON body, or SSE chunks (one choice per chunk)

A refusal by the engine before any output becomes a 400 (503 if the engine is gone); a
failure later ends the stream with an error event. A client that goes away (stream or
not, before its first token or after) has its requests aborted in the engine as soon as
its connection closes: one task per HTTP request waits on the connection (``_watch``), not
a poll between deltas, so a request still queued in the engine (no delta yet) is freed
too. Admission slots are released when each engine request's stream ends, whatever the
HTTP side did.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from triptych.api.admission import Slots
from triptych.api.errors import APIError
from triptych.api.metrics import Metrics, RequestTimes
from triptych.api.openai_format import Choice, Formatter, PromptInfo
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.router.prompt import ProcessedPrompt
from triptych.router.router import EngineDeadError
from triptych.router.turns import Turns
from triptych.worker import wire

logger = logging.getLogger("triptych.api")


@dataclass
class Job:
    """One prompt of a request: what goes to the engine and what the answer says of it."""

    prompt: ProcessedPrompt
    params: SamplingParams
    info: PromptInfo


class Generation:
    """The engine streams of one HTTP request, submitted together, deltas merged."""

    def __init__(self, client: Any, rid: str, jobs: list[Job], slots: Slots) -> None:
        self.client, self.rid, self.jobs, self.slots = client, rid, jobs, slots
        self._q: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, Any]] = []
        self._tasks: list[asyncio.Task] = []

    async def _pump(self, i: int, stream: AsyncIterator[wire.RequestDelta]) -> None:
        try:
            async for d in stream:
                self._q.put_nowait((i, d))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which decides
            self._q.put_nowait((i, e))

    async def start(self, stream: bool = True) -> None:
        """Submit every job; return once each has its first output (raise if refused,
        ``ClientGone`` if the client left first). ``stream`` False: the answer is read
        whole, so the engine's texts are decoded once, at the end (unless stop strings
        need them sooner), not token by token."""
        for i, job in enumerate(self.jobs):
            rid = self.rid if len(self.jobs) == 1 else f"{self.rid}-{i}"
            deltas = self.client.submit(rid, job.prompt, job.params, stream=stream)
            task = asyncio.ensure_future(self._pump(i, deltas))
            task.add_done_callback(lambda _, k=job.params.n: self.slots.release(k))
            self._tasks.append(task)
        seen: set[int] = set()
        try:
            while len(seen) < len(self.jobs):
                i, item = await self._q.get()
                if isinstance(item, ClientGone):
                    raise item
                if isinstance(item, Exception):
                    raise _refusal(item)
                seen.add(i)
                self._buffer.append((i, item))
        except BaseException:
            await self.aclose()
            raise

    async def next(self) -> tuple[int, Any]:
        """The next (job index, delta or error); (-1, ClientGone) once the client left."""
        if self._buffer:
            return self._buffer.pop(0)
        return await self._q.get()

    async def client_gone(self) -> None:
        """The client closed its connection: abort every engine request now, and have the
        reader (``start`` or the responder) stop at its next item."""
        self._q.put_nowait((-1, ClientGone()))
        await self.aclose()

    async def aclose(self) -> None:
        """Abort what is still running (shielded: a disconnect cancels our caller), then
        give back what the prompts hold outside P0's memory (prepared pixels)."""
        with anyio.CancelScope(shield=True):
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self.jobs:
            job.prompt.release()


class Responder:
    """Writes one request's answer from its Generation, recording its metrics."""

    def __init__(self, gen: Generation, fmt: Formatter, metrics: Metrics, raw: Request,
                 n: int) -> None:
        self.gen, self.fmt, self.metrics, self.raw, self.n = gen, fmt, metrics, raw, n
        now = time.monotonic()  # arrival: time to first token counts the engine's queue
        self.times = [RequestTimes(now, n) for _ in gen.jobs]
        self.infos = [job.info for job in gen.jobs]
        self._seen: set[int] = set()
        self.num_tokens = 0

    async def respond(self, stream: bool, include_usage: bool = False,
                      continuous_usage: bool = False) -> Response:
        """Submit, then answer with one JSON body or an SSE stream. The connection is
        watched from here on: a client that leaves while its request still waits for a
        first token has it aborted as well."""
        watch = asyncio.ensure_future(_watch(self.raw, self.gen))
        try:
            await self.gen.start(stream)
        except ClientGone:
            watch.cancel()
            self._submitted()
            self._end_unfinished("abort")
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            watch.cancel()
            raise
        self._submitted()
        if stream:
            return StreamingResponse(self._sse(include_usage, continuous_usage, watch),
                                     media_type="text/event-stream")
        return await self._whole(watch)

    def _submitted(self) -> None:
        for job in self.gen.jobs:
            self.metrics.request_submitted(self.n, job.params.max_tokens,
                                           job.params.max_tokens or 0)

    def _account(self, i: int, d: wire.RequestDelta) -> None:
        self.infos[i].num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None and self.infos[i].prompt_logprobs is None:
            self.infos[i].prompt_logprobs = d.prompt_logprobs
        if i not in self._seen:
            self._seen.add(i)
            self.metrics.prompt_seen(d.num_prompt_tokens, d.num_cached_tokens)
        for c in d.completions:
            self.num_tokens += len(c.token_ids)
            if c.token_ids:
                self.metrics.tokens_arrived(self.times[i], c.index, len(c.token_ids))
            if c.finish_reason:
                self.metrics.completion_finished(self.times[i], c.index, c.finish_reason)

    def _end_unfinished(self, reason: str) -> None:
        for t in self.times:
            for idx in range(self.n):
                self.metrics.completion_finished(t, idx, reason)

    async def _events(self, on_delta: Callable[[int, wire.RequestDelta], Any]
                      ) -> AsyncIterator[Any]:
        """Deltas in arrival order (each passed to on_delta), until all jobs finished;
        ``ClientGone`` when the watch saw the connection close."""
        done, turns = 0, Turns()
        while done < len(self.gen.jobs):
            i, d = await self.gen.next()
            if isinstance(d, Exception):
                raise d
            self._account(i, d)
            yield on_delta(i, d)
            done += d.finished
            await turns.take()  # (a backlog of deltas in turns with other requests)

    async def _whole(self, watch: asyncio.Future) -> Response:
        choices = [Choice() for _ in range(len(self.gen.jobs) * self.n)]

        def add(i: int, d: wire.RequestDelta) -> None:
            for c in d.completions:
                self.fmt.add(choices[i * self.n + c.index], c, self.infos[i])

        try:
            async for _ in self._events(add):
                pass
        except ClientGone:
            logger.info("client gone; aborted %s", self.gen.rid)
            self._end_unfinished("abort")
            return Response(status_code=499)  # nobody reads it
        except Exception as e:  # noqa: BLE001 - failed mid-way
            self._end_unfinished("error")
            err = _refusal(e)
            raise APIError(503 if err.status == 503 else 500, err.message, "server_error"
                           ) from None
        finally:
            watch.cancel()
            await self.gen.aclose()
        if self.fmt.s.logprobs is None:
            return Response(self.fmt.whole(self.infos, choices), media_type="application/json")
        # NOTE: logprobs can make a whole answer tens of MB: it goes out piece by piece, the
        # event loop free between pieces, never joined into one string (api/openai_format.py)
        return StreamingResponse(_pieces(self.fmt.whole_pieces(self.infos, choices)),
                                 media_type="application/json")

    async def _sse(self, include_usage: bool, continuous: bool, watch: asyncio.Future
                   ) -> AsyncIterator[str]:
        fmt = self.fmt
        offsets = [0] * (len(self.infos) * self.n)  # completions: text sent per choice
        opened: set[int] = set()  # completions choices whose first chunk went out
        extra = {"prompt_token_ids": self.infos[0].token_ids} \
            if fmt.s.chat and fmt.s.token_ids else {}
        # vLLM: usage in every chunk that carries a choice only when include_usage is set
        # too; each says its own prompt and the tokens of its choice so far.
        continuous = continuous and include_usage
        sent = [0] * len(offsets)  # tokens streamed per choice

        def usage(idx: int) -> dict | None:
            return fmt.usage([self.infos[idx // self.n]], sent[idx]) if continuous else None

        def chunks(i: int, d: wire.RequestDelta) -> list[str]:
            out = []
            if d.prompt_logprobs is not None and fmt.s.prompt_logprobs:  # once per prompt
                out.append(fmt.sse([], prompt_logprobs=fmt.prompt_logprobs(d.prompt_logprobs),
                                   prompt_index=i))
            for c in d.completions:
                idx = i * self.n + c.index
                sent[idx] += len(c.token_ids)
                first = None if fmt.s.chat or idx in opened else self.infos[i]
                opened.add(idx)
                ch = fmt.chunk_choice(idx, c, offsets[idx], first)
                out.append(fmt.sse([ch], usage(idx)))
                # text_offset follows the tokens, as the whole answer's does (the text
                # itself may lag them: a possible stop string is held back)
                lp = ch.get("logprobs") if not fmt.s.chat else None
                offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1]) \
                    if lp and lp["tokens"] else offsets[idx] + len(ch.get("text", ""))
            return out

        try:
            for k, ch in enumerate(fmt.opening(self.infos)):
                yield fmt.sse([ch], usage(ch["index"]), **(extra if k == 0 else {}))
            async for batch in self._events(chunks):
                for chunk in batch:
                    yield chunk
        except ClientGone:
            self._end_unfinished("abort")
            return
        except Exception as e:  # noqa: BLE001 - failed mid-way: say so, end
            self._end_unfinished("error")
            err = _refusal(e)
            yield fmt.sse_error(503 if err.status == 503 else 500, err.message, "server_error")
            yield "data: [DONE]\n\n"
            return
        finally:
            watch.cancel()
            self._end_unfinished("abort")  # (no-op for completions that finished)
            await self.gen.aclose()
        if include_usage:
            yield fmt.sse([], fmt.usage(self.infos, self.num_tokens))
        yield "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed its connection."""


async def _watch(raw: Request, gen: Generation) -> None:
    """Wait for the client's connection to close, then abort ``gen``. The body is already
    read, so the next ASGI message is ``http.disconnect`` (uvicorn sends it when the socket
    closes); cancelled once the answer is written."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    await gen.client_gone()


async def _pieces(pieces: Iterator[str], size: int = 1 << 18) -> AsyncIterator[bytes]:
    """``pieces`` as UTF-8 chunks of about ``size`` bytes, yielding the event loop between
    chunks (each is awaited out to the socket by the response)."""
    buf: list[str] = []
    n = 0
    for p in pieces:
        buf.append(p)
        n += len(p)
        if n >= size:
            yield "".join(buf).encode()
            buf, n = [], 0
            await asyncio.sleep(0)
    if buf:
        yield "".join(buf).encode()


def _refusal(e: Exception) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error")
    if isinstance(e, ValueError):  # the engine refused the input; its words are for clients
        return APIError(400, str(e))
    logger.error("engine request failed", exc_info=e)
    return APIError(500, "internal server error", "server_error")


__all__ = ["Generation", "Job", "Responder"]
