"""GrammarChecker: P0's compile check of a request's output constraint, bounded and fair.

    check(spec, tenant)
      verdict known?  -> at once (kept for 1,024 specs; a timed-out compile is not kept)
      the tenant's queue, served round-robin over tenants; a tenant runs at most
      ``procs - 1`` compiles at once (one if ``procs`` is 1), so one tenant's slow
      schemas always leave a compile process to the others
      a compile process (api/grammar_proc.py) -> the verdict; one that overruns
      ``timeout_s`` (counted from when it starts compiling, not from the queue) is killed
      and started again for the next job

The processes start on the first structured request (each imports xgrammar, ~270 MB) and
die with P0. A worker still compiles in its own threads (engine/structured/grammar_compiler.py): it
sees only specs P0 has compiled within the bound.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
from collections import OrderedDict, deque
from typing import Any

import msgspec
from triptych.api.grammar_proc import Job, Start, Verdict
from triptych.engine.structured.structured_params import StructuredOutputsParams

logger = logging.getLogger("triptych.grammar_check")

VERDICTS = 1024  # specs whose verdict is kept (least recently used go first)
MAX_WAITING = 16  # a tenant's compiles waiting at once; more are refused (429)
START_TIMEOUT_S = 120.0  # a compile process's start (imports xgrammar and torch)
Key = tuple[str, str, bool, bool]


class CompileBusy(Exception):
    """This tenant already has MAX_WAITING compiles waiting (HTTP 429)."""


class CheckerDown(Exception):
    """A compile process would not start (HTTP 503)."""


def _frame(obj: msgspec.Struct) -> bytes:
    data = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(data)) + data


class _Proc:
    """One compile process: started in the background (at the checker's first use, and
    again at once after a kill), so a job rarely waits for one to start."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def warm(self, info: str) -> asyncio.Task:
        """The start of the process (begun now unless one is running or done)."""
        if self._starting is None or (self._starting.done() and not self.alive):
            self._starting = asyncio.get_running_loop().create_task(self._start(info))
        return self._starting

    async def run(self, key: Key, timeout_s: float, info: str) -> Verdict:
        """The verdict on ``key``; asyncio.TimeoutError (the process killed) past
        ``timeout_s`` of compiling. A process that dies mid-compile (the compiler crashed
        on this spec) is a verdict too."""
        await self.warm(info)
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(_frame(Job(key)))
        try:
            await self.proc.stdin.drain()
            return await asyncio.wait_for(self._read(), timeout_s)
        except asyncio.TimeoutError:
            self.kill()
            raise
        except (asyncio.IncompleteReadError, ConnectionError):
            self.kill()
            return Verdict(f"invalid {key[0]} constraint: the compiler failed on it")

    async def _start(self, info: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "triptych.api.grammar_proc", env=env,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            assert self.proc.stdin is not None
            self.proc.stdin.write(_frame(Start(info)))
            await self.proc.stdin.drain()
            await asyncio.wait_for(self._read(), START_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            self.kill()
            raise CheckerDown("the structured-output compile process did not start "
                              f"({type(e).__name__})") from None

    async def _read(self) -> Verdict:
        assert self.proc is not None and self.proc.stdout is not None
        (n,) = struct.unpack(">I", await self.proc.stdout.readexactly(4))
        return msgspec.msgpack.decode(await self.proc.stdout.readexactly(n), type=Verdict)

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()  # (asyncio's child watcher reaps it)
        self.proc = None
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        self._starting = None


class GrammarChecker:
    """Compile checks of one tokenizer's specs (P0's), ``procs`` at a time."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 procs: int = 2, timeout_s: float = 10.0) -> None:
        self._tok = (tokenizer, vocab_size, eos_token_id)
        self._info: str | None = None  # xgrammar's TokenizerInfo as JSON, made once
        self._info_lock = asyncio.Lock()
        self.timeout_s = timeout_s
        self.share = max(1, procs - 1)
        self._procs = [_Proc() for _ in range(procs)]
        self._idle = list(self._procs)
        self._verdicts: OrderedDict[Key, str | None] = OrderedDict()
        self._compiling: dict[Key, asyncio.Future] = {}
        self._queues: dict[str | None, deque[tuple[Key, asyncio.Future]]] = {}
        self._running: dict[str | None, int] = {}
        self._turn: deque[str | None] = deque()  # tenants with queued jobs, round-robin
        self._tasks: set[asyncio.Task] = set()

    @property
    def pids(self) -> list[int]:
        """The compile processes running now."""
        return [p.pid for p in self._procs if p.pid is not None]

    async def check(self, spec: StructuredOutputsParams, tenant: str | None) -> None:
        """Raises ValueError naming the problem (a bad spec, one that matches nothing, or
        a compile past the timeout), CompileBusy or CheckerDown."""
        key = spec.key
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            err = self._verdicts[key]
        else:
            if self._info is None:
                await self._make_info()
                for p in self._procs:
                    p.warm(self._info)
            queue = self._queues.setdefault(tenant, deque())
            if sum(not f.done() for _, f in queue) >= MAX_WAITING:
                raise CompileBusy
            fut = asyncio.get_running_loop().create_future()
            queue.append((key, fut))
            if tenant not in self._turn:
                self._turn.append(tenant)
            self._pump()
            err = await fut
        if err is not None:
            raise ValueError(err)

    async def _make_info(self) -> None:
        async with self._info_lock:
            if self._info is None:
                self._info = await asyncio.to_thread(_tokenizer_info, *self._tok)

    def _next(self) -> tuple[str | None, Key, asyncio.Future] | None:
        """The next job to start: the first tenant in turn with work and room in its share."""
        for _ in range(len(self._turn)):
            tenant = self._turn[0]
            self._turn.rotate(-1)
            queue = self._queues[tenant]
            while queue and queue[0][1].done():  # its client went away
                queue.popleft()
            if not queue:
                self._turn.remove(tenant)
                del self._queues[tenant]
            elif self._running.get(tenant, 0) < self.share:
                key, fut = queue.popleft()
                return tenant, key, fut
        return None

    def _pump(self) -> None:
        while self._idle and (job := self._next()) is not None:
            tenant, key, fut = job
            if key in self._verdicts:
                fut.set_result(self._verdicts[key])
                continue
            shared = self._compiling.get(key)
            if shared is None:  # (a compile of the same spec already running is joined)
                shared = self._compiling[key] = asyncio.get_running_loop().create_future()
                self._running[tenant] = self._running.get(tenant, 0) + 1
                proc = next((p for p in self._idle if p.alive), self._idle[0])
                self._idle.remove(proc)
                task = asyncio.get_running_loop().create_task(
                    self._run(proc, tenant, key, shared))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            shared.add_done_callback(lambda s, f=fut: _copy(s, f))

    async def _run(self, proc: _Proc, tenant: str | None, key: Key,
                   shared: asyncio.Future) -> None:
        try:
            assert self._info is not None
            verdict = await proc.run(key, self.timeout_s, self._info)
            self._verdicts[key] = verdict.error
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)
            shared.set_result(verdict.error)
        except asyncio.TimeoutError:  # (killed: started again at once, for the next job)
            proc.warm(self._info)
            shared.set_result(f"the {key[0]} constraint took longer than {self.timeout_s:g} s "
                              "to compile (--grammar-compile-timeout); use a smaller schema "
                              "or grammar")
        except Exception as e:  # noqa: BLE001 - CheckerDown: every waiter gets it
            shared.set_exception(e)
        finally:
            del self._compiling[key]
            self._running[tenant] -= 1
            if not self._running[tenant]:
                del self._running[tenant]
            self._idle.append(proc)
            self._pump()

    async def prewarm(self) -> None:
        """Start the compile processes now, not at the first structured request: each
        imports xgrammar (~1.5 s of CPU); on a server with several tenants that start would
        fall on whoever shares the box with the first tenant to ask for a grammar."""
        try:
            await self._make_info()
            assert self._info is not None
            await asyncio.gather(*(p.warm(self._info) for p in self._procs))
        except CheckerDown as e:  # (the first check retries, and names it)
            logger.warning("structured output: %s", e)

    def close(self) -> None:
        for p in self._procs:
            p.kill()
        for t in list(self._tasks):
            t.cancel()


def _copy(src: asyncio.Future, dst: asyncio.Future) -> None:
    if dst.done():
        return
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> str:
    import xgrammar as xgr

    stop = [eos_token_id] if eos_token_id is not None else None
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stop).serialize_json()


__all__ = ["CheckerDown", "CompileBusy", "GrammarChecker"]
