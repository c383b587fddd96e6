"""The router's request state: a client request, its children, each child's attempts.

    ClientRequest   what submit() was given; its queue feeds the caller's stream
      Child         one of its n completions (the OutputProcessor's child id)
        Attempt     one try of the child on the workers, under its own core id
                    ``<child id>@<number>``: the id the workers know it by

An attempt owns everything one try holds on the workers: which worker streams its tokens,
the decode worker its KV goes to, the encode worker encoding its items, the work charged to
each, the decode outputs that overtook the prefill worker's hand-off, the KV reservation it
waits for, the processor-cache ring entries it pins. Ending it (``RequestTable.end``) gives
all of that back at once and takes its core id off the table, so anything a worker still
sends for it later (a late output, a late reservation) finds nothing and is dropped.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from triptych.router.prompt import ProcessedPrompt
from triptych.engine.outputs import EngineCoreOutput
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.router.handle import WorkerHandle


@dataclass(eq=False)
class ClientRequest:
    request_id: str
    prompt: ProcessedPrompt
    queue: asyncio.Queue  # RequestOutput, or the exception that ends the request
    children: list[Child] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # prompt block hashes (routing)


@dataclass(eq=False)
class Child:
    child_id: str
    params: SamplingParams
    parent: ClientRequest
    attempt: Attempt | None = None  # the current (or last) attempt
    num_attempts: int = 0  # attempts started so far
    migrations: int = 0  # attempts that ended because a worker failed it
    done: bool = False  # finished, failed or aborted: no attempt follows


class Attempt:
    """One try of a child on the workers."""

    def __init__(self, child: Child, number: int) -> None:
        self.child = child
        self.core_id = f"{child.child_id}@{number}"
        self.worker: WorkerHandle | None = None  # streams its tokens now (a prefill worker
        # until the hand-off)
        self.decode: WorkerHandle | None = None  # P/D: the decode worker that receives its KV
        self.encode: WorkerHandle | None = None  # encoding its items (until EncodeDone)
        self.charges: list[tuple[WorkerHandle, int]] = []  # work charged to each worker
        self.early: list[EngineCoreOutput] = []  # decode outputs that came before the
        # prefill worker's hand-off output
        self.reserved: asyncio.Future | None = None  # P/D: the decode worker's KVReserved
        self.pins: list[str] = []  # processor-cache ring entries it holds
        self.ended = False

    @property
    def workers(self) -> list[WorkerHandle]:
        """Every worker holding part of it now (each once)."""
        return list(dict.fromkeys(w for w in (self.worker, self.decode, self.encode)
                                  if w is not None))

    def charge(self, w: WorkerHandle, work: int) -> None:
        """Count ``work`` as queued on ``w`` until the attempt is done with it."""
        if self.ended:  # NOTE: a run that went on after its attempt ended charges nothing
            return
        w.load += work
        self.charges.append((w, work))

    def uncharge(self, only: WorkerHandle | None = None) -> None:
        """Take back what was charged (to ``only``, or to every worker)."""
        keep = []
        for w, n in self.charges:
            if only is None or w is only:
                w.load -= n
            else:
                keep.append((w, n))
        self.charges = keep

    def release(self, unpin: Callable[[list[str]], None]) -> list[WorkerHandle]:
        """Give back what it holds; the live workers that held it (theirs to abort)."""
        held = [w for w in self.workers if w.up]
        self.ended = True
        self.uncharge()
        unpin(self.pins)
        self.pins = []
        if self.reserved is not None and not self.reserved.done():
            self.reserved.cancel()
        self.worker = self.decode = self.encode = self.reserved = None
        self.early = []
        return held


class RequestTable:
    """Client requests by id, children by child id, live attempts by core id."""

    def __init__(self, unpin: Callable[[list[str]], None]) -> None:
        self._unpin = unpin  # the pixel planner's: a ring entry an attempt pinned
        self.requests: dict[str, ClientRequest] = {}
        self.children: dict[str, Child] = {}
        self.attempts: dict[str, Attempt] = {}

    def add(self, request: ClientRequest, children: list[Child]) -> None:
        """A new client request and its children (no attempt yet)."""
        request.children = children
        self.requests[request.request_id] = request
        for c in children:
            self.children[c.child_id] = c

    def drop(self, request: ClientRequest) -> None:
        """Forget a request whose children are all done."""
        for c in request.children:
            self.children.pop(c.child_id, None)
        self.requests.pop(request.request_id, None)

    def start_attempt(self, c: Child) -> Attempt:
        """The child's next attempt, now its current one (after the last one ended)."""
        a = Attempt(c, c.num_attempts)
        c.num_attempts += 1
        c.attempt = a
        self.attempts[a.core_id] = a
        return a

    def end(self, a: Attempt) -> list[WorkerHandle]:
        """End an attempt (idempotent); the live workers that held it."""
        if a.ended:
            return []
        self.attempts.pop(a.core_id, None)
        return a.release(self._unpin)

    def live(self, core_id: str) -> Attempt | None:
        """The live attempt a worker's message names, else None (ended, or never ours)."""
        return self.attempts.get(core_id)

    def on(self, w: WorkerHandle) -> list[Attempt]:
        """Live attempts that ``w`` holds part of."""
        return [a for a in self.attempts.values() if w in a.workers]
