"""Tenant shares of a step: one tenant's sequences cannot make the others' steps much
slower than they are without them.

Continuous batching runs everyone's sequences in the same step, so a tenant with sixteen
long sequences makes every other tenant's token take as long as its whole batch does (a
16-token chat beside ``n=16, max_tokens=1500`` read x3.8 on a 2-core CPU). When requests
of two or more tenants (``SamplingParams.tenant``: the API key's on a server with keys;
none offline) have work, the busiest tenant (the most work asked, by ``size``: tokens
plus the context they attend) is held to a cap:

    step time with it  <=  (1 + share) x  step time without it

measured, not modelled: one step in EXPLORE_EVERY runs without the busiest tenant (the
others' step alone), the rest with it under the cap; the cap shrinks while the steps
with it run over the bound and grows back while they run under it. A tenant held to
its cap has its sequences take turns (least recently served first) and its prompt
chunks cut to fit; it runs at least one sequence a step but in those it sits out, so
nobody stalls. No tenant is held below what the busiest other tenant asks, so tenants
that ask alike share steps as before; a tenant alone keeps the whole step. The busiest
pays: while contended it runs at most its share and sits out one step in EXPLORE_EVERY.
``--tenant-step-share`` sets ``share`` (0: off, first come first served as vLLM's
scheduler).
"""
from __future__ import annotations

import random
import time

from triptych.engine.request import Request

IDLE_S = 1.0  # a gap this long between two schedules is an idle engine, not a step
EXPLORE_EVERY = 8  # contended steps, on average, between two without the busiest tenant
# (drawn at random: a period could lock onto the requests' own rhythm)
SHRINK, GROW = 0.8, 1.05  # the cap's steps down (over the bound) and up (under it)
CTX_PER_TOKEN = 1024  # context tokens attended that weigh as much as one token computed


def tenant_of(req: Request) -> str:
    return req.sampling_params.tenant or ""


def attended(ctx: int, n: int) -> int:
    """Context tokens ``n`` new tokens after ``ctx`` computed ones attend (causal)."""
    return n * ctx + n * (n + 1) // 2


def size(ctx: int, n: int) -> float:
    """What ``n`` new tokens after ``ctx`` computed ones weigh in a step (the caps' unit)."""
    return n + attended(ctx, n) / CTX_PER_TOKEN


class StepShares:
    """One schedule's accounting: what each tenant may still take this step."""

    def __init__(self, caps: dict[str, float]) -> None:
        self.caps = caps  # tenant -> size it may take (< 0: it sits this step out)
        self.used: dict[str, float] = {}  # tenant -> size scheduled this step
        self.deferred = 0  # sequences held back or cut this step

    def take(self, req: Request, n: int, ctx: int, chunkable: bool) -> int:
        """Tokens of ``req`` (``n`` wanted, ``ctx`` already computed) this step may run:
        ``n``, fewer (a prompt chunk cut to its tenant's room), or 0 (it waits a step). A
        tenant's sequences join while what it took is under its cap (the last may pass it:
        tenants asking alike share whole steps)."""
        tenant = tenant_of(req)
        cap = self.caps.get(tenant)
        if cap is None:
            return n
        used, asked = self.used.get(tenant), n
        room = cap - (used or 0.0)
        if cap < 0:
            n = 0  # (its turn to sit a step out)
        elif chunkable and n > 1 and size(ctx, n) > room:
            m = self._fit(ctx, n, room)  # a prompt chunk: cut to the room left
            n = m if m >= 1 else (1 if used is None else 0)
        elif room <= 0 and used is not None:
            n = 0  # its tenant took its share of this step: it takes its turn later
        self.deferred += n < asked
        if n:
            self.used[tenant] = (used or 0.0) + size(ctx, n)
        return n

    @staticmethod
    def _fit(ctx: int, n: int, room: float) -> int:
        lo, hi = 0, n  # the most tokens whose size fits the room (size grows with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if size(ctx, mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _ewma(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class TenantShares:
    """The engine's shares: the busiest tenant's cap, kept to the measured bound."""

    def __init__(self, share: float) -> None:
        self.share = share  # --tenant-step-share (0: off)
        self.cap: float | None = None  # size the busiest tenant may take a step
        self.alone_s: float | None = None  # a step without the busiest tenant (average)
        self.with_s: float | None = None  # a step with it, under its cap (average)
        self.deferrals_total = 0  # sequences held back or cut to keep a tenant to its share
        self.explore_every = EXPLORE_EVERY  # (tests: 0 never, 1 always)
        self._draw = random.Random(0)
        self._kind = ""  # this schedule's: "" (no shares) | "alone" | "with"
        self._last: tuple[float, str] | None = None  # the previous schedule's (time, kind)

    def plan(self, demands: dict[str, list[tuple[int, int]]]) -> StepShares | None:
        """``demands``: tenant -> (context, tokens) of each sequence it would run now.
        None when nobody is crowded out (one tenant, or shares off)."""
        self._kind = ""
        if self.share <= 0 or len(demands) < 2:
            return None
        asks = {t: sum(size(c, n) for c, n in seqs) for t, seqs in demands.items()}
        busiest = max(asks, key=asks.__getitem__)
        if self.cap is None:
            self.cap = asks[busiest]
        self.cap = max(1.0, min(self.cap, asks[busiest]))
        caps = {t: max([self.cap] + [a for u, a in asks.items() if u != t]) for t in asks}
        if self.explore_every and (self.alone_s is None or
                                   self._draw.random() * self.explore_every < 1):
            caps[busiest], self._kind = -1.0, "alone"
        else:
            self._kind = "with"
        return StepShares(caps)

    def scheduled(self, now: float | None = None) -> None:
        """After each schedule: the gap since the previous one is that step's time (its
        forward, sampling and the worker loop around it); the cap follows the bound."""
        now = time.perf_counter() if now is None else now
        if self._last is not None and now - self._last[0] < IDLE_S:
            gap, kind = now - self._last[0], self._last[1]
            if kind == "alone":
                self.alone_s = _ewma(self.alone_s, gap, 0.3)
            elif kind == "with" and self.alone_s is not None and self.cap is not None:
                self.with_s = _ewma(self.with_s, gap, 0.2)
                over = self.with_s > (1 + self.share) * self.alone_s
                self.cap *= SHRINK if over else GROW
        self._last = (now, self._kind) if self._kind else None
