"""Tenant shares of a step: one tenant's sequences cannot make the others' steps much
slower than they are without them.

Continuous batching runs everyone's sequences in the same step, so a tenant with sixteen
long sequences makes every other tenant's token take as long as its whole batch does (a
16-token chat beside ``n=16, max_tokens=1500`` read x3.8 on a 2-core CPU). When requests
of two or more tenants (``SamplingParams.tenant``: the API key's on a server with keys;
none offline) have work, the busiest tenant (the most work asked, by ``size``: tokens,
a row per sequence and the context they attend) is held to a cap:

    step time with it  <=  (1 + share) x  step time without it

measured, not modelled: one step in EXPLORE_EVERY runs without the busiest tenant (the
others' step alone), the rest with it under the cap; the cap shrinks while the steps
with it run over the bound and grows back while they run under it. A tenant held to
its cap has its sequences take turns (TURN_STEPS steps each, ``took_turn``) and its prompt
chunks cut to fit; it runs at least one sequence a step but in those it sits out, so
nobody stalls. No tenant is held below what the busiest other tenant asks, so tenants
that ask alike share steps as before; a tenant alone keeps the whole step. The busiest
pays: while contended it runs at most its share and sits out one step in EXPLORE_EVERY
(one in 64 while its steps cost the others less than half the bound allows).
The cap starts, at a first contention, from what the others ask, and the bound grows it;
it is kept between contentions, and for LINGER_S after the others' last request ended
the busiest stays held to it (``TenantShares.linger``): a client whose requests come one
after another finds a short step in flight, not one of every sequence the busiest has.
``--tenant-step-share`` sets ``share`` (0: off, first come first served as vLLM's
scheduler).

Seats (``max_num_seqs``) are shared the same way: while every seat is taken and a tenant
holding fewer than its part (``max_num_seqs`` / tenants with work) waits, the tenant
holding the most gives back its most recently admitted sequence (preempted: recomputed
later, mostly from the prefix cache), and a waiting request of a tenant that holds its
part lets the others' go first. Otherwise one tenant's n=16 requests could hold every
seat for a whole generation while another's one-line chat waits.
"""
from __future__ import annotations

import random
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter

from triptych.engine.request import Request

IDLE_S = 1.0  # a gap this long between two schedules is an idle engine, not a step
EXPLORE_EVERY = 8  # contended steps, on average, between two without the busiest tenant
# (drawn at random: a period could lock onto the requests' own rhythm)
MAX_STRETCH = 8  # while its steps cost the others little, it sits out less: down to one
# step in EXPLORE_EVERY x this (a GPU, where one more sequence costs a step almost nothing)
SHRINK, GROW = 0.8, 1.05  # the cap's steps down (over the bound) and up (under it)
CTX_PER_TOKEN = 1024  # context tokens attended that weigh as much as one token computed
ROW_TOKENS = 4  # what a sequence's row in a step weighs beyond its tokens, in tokens: its
# attention call, sampling and output (and a row rejoining the batch is rewritten). On the
# 2-core CPU a decode row beside others cost ~18 us, a prompt token ~4 us; without it a
# chat's 7-token prompt let the busiest tenant run 7 decodes in that step (+0.45 ms)
TURN_STEPS = 8  # steps a held tenant's sequence runs before the next takes its turn
LINGER_S = 0.05  # the busiest stays held this long after the others' last request ended


def tenant_of(req: Request) -> str:
    return req.sampling_params.tenant or ""


PREFILL_RANK = 1 << 60  # added to a rank: prompt chunks after decodes
ON_TURN = -1  # the rank of a sequence whose turn is not over


def took_turn(req: Request, step: int) -> None:
    """After ``req`` was scheduled in ``step``: its turn order for the next schedules.
    A tenant held to a few of its sequences runs the same ones for TURN_STEPS steps (a
    sequence on its turn goes first, even after a step it sat out), then the longest
    held ones take theirs: a sequence rejoining the batch rewrites its row (~20 us on a
    CPU), so turns do not change every step. Kept on the request, so that ordering a
    tenant's 128 sequences is one C-level sort (``attrgetter``), not 128 key calls."""
    req.turn_steps = 1 if req.turn_steps >= TURN_STEPS else req.turn_steps + 1
    rank = ON_TURN if req.turn_steps < TURN_STEPS else step
    req.turn_rank = rank + PREFILL_RANK \
        if req.num_computed_tokens < len(req.prompt_token_ids) else rank


RANK = attrgetter("turn_rank")


def attended(ctx: int, n: int) -> int:
    """Context tokens ``n`` new tokens after ``ctx`` computed ones attend (causal)."""
    return n * ctx + n * (n + 1) // 2


def size(ctx: int, n: int) -> float:
    """What ``n`` new tokens after ``ctx`` computed ones weigh in a step (the caps' unit):
    the tokens, the sequence's row (ROW_TOKENS) and the context they attend."""
    return n + ROW_TOKENS + attended(ctx, n) / CTX_PER_TOKEN


class StepShares:
    """One schedule's accounting: what each tenant may still take this step."""

    def __init__(self, caps: dict[str, float],
                 groups: dict[str, list[Request]] | None = None) -> None:
        self.caps = caps  # tenant -> size it may take (< 0: it sits this step out)
        self.groups = groups  # tenant -> its running sequences (``survey``'s), if known
        self.used: dict[str, float] = {}  # tenant -> size scheduled this step
        self.done = {t for t, c in caps.items() if c < 0}  # tenants that took their share
        # of this step (or sit it out)
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
            self.used[tenant] = used = (used or 0.0) + size(ctx, n)
            if used >= cap:
                self.done.add(tenant)
        elif cap < 0:
            self.done.add(tenant)
        return n

    def order(self, running: list[Request]) -> Iterator[Request]:
        """The running sequences in this step's order: decodes first, then prompt chunks;
        each tenant's in its turn order (``took_turn``). A tenant that took its share of
        the step (or sits it out) is passed over whole: the rest of its sequences count
        as deferred, none is looked at (a held tenant's 127 others cost nothing)."""
        groups = self.groups if self.groups is not None else survey(running, None, 0)[1]
        parts = []
        for t, g in groups.items():
            g = sorted(g, key=RANK)
            parts.append((t, g, bisect_left(g, PREFILL_RANK, key=RANK)))
        for prefill in (False, True):
            for t, g, k in parts:
                lo, hi = (k, len(g)) if prefill else (0, k)
                for i in range(lo, hi):
                    if t in self.done:
                        self.deferred += hi - i
                        break
                    yield g[i]

    def held(self, req: Request) -> bool:
        """Whether ``req``'s tenant has taken its share of this step already (its other
        sequences wait: the scheduler skips them without looking further)."""
        if (req.sampling_params.tenant or "") in self.done:
            self.deferred += 1
            return True
        return False

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
        self.seat_preemptions_total = 0  # sequences preempted to seat another tenant's
        self.explore_every = EXPLORE_EVERY  # (tests: 0 never, 1 always)
        self.stretch = 1  # x explore_every: doubled while the bound is met with room
        self._draw = random.Random(0)
        self._kind = ""  # this schedule's: "" (no shares) | "alone" | "with"
        self._last: tuple[float, str] | None = None  # the previous schedule's (time, kind)
        self._held: str | None = None  # the tenant last held to the cap, and when
        self._held_at = float("-inf")

    def begin(self, running: list[Request], waiting: deque[Request], tenants: Counter[str],
              tokens_to_compute: Callable[[Request], int], max_tokens: int, max_seqs: int,
              now: float | None = None) -> tuple[StepShares | None, Seats | None]:
        """A schedule's shares and seats (``tenants``: unfinished requests per tenant,
        running or waiting); (None, None) while fewer than two tenants have requests, or
        shares are off: then nothing here walks the queues. For LINGER_S after the others'
        last request ended, the tenant that was held stays held to its cap (``linger``)."""
        self._kind = ""
        if self.share <= 0:
            return None, None
        now = time.perf_counter() if now is None else now
        if len(tenants) < 2:
            return self.linger(running, now), None
        asks, groups = survey(running, tokens_to_compute, max_tokens)
        seats = Seats(running, waiting, max_seqs, tenants,
                      Counter({t: len(g) for t, g in groups.items()})) if waiting else None
        plan = self.plan(add_waiting(asks, waiting, seats, len(running) < max_seqs,
                                     max_tokens))
        if plan is not None:
            plan.groups = groups
            self._held_at = now
        return plan, seats

    def linger(self, running: list[Request], now: float) -> StepShares | None:
        """The held tenant, alone again, keeps its cap for LINGER_S: a client sending its
        requests one after another (a script, an agent between tool calls) finds a step
        of the cap's size in flight when its next request comes, not one of every
        sequence the busiest tenant has (16 ms for 128 on a 2-core CPU against a 12 ms
        chat; the sequences rejoining the batch cost ~20 us each as well). Steps in it
        measure nothing: nobody else's step is there to compare."""
        if (self._held is None or self.cap is None or now - self._held_at >= LINGER_S
                or not running or tenant_of(running[0]) != self._held):
            return None
        return StepShares({self._held: self.cap})

    def plan(self, asks: dict[str, float]) -> StepShares | None:
        """``asks``: tenant -> the size of what it would run now (``survey`` and
        ``add_waiting``). None when nobody is crowded out (one tenant, or shares off)."""
        self._kind = ""
        if self.share <= 0 or len(asks) < 2:
            return None
        busiest = max(asks, key=asks.__getitem__)
        self._held = busiest
        if self.cap is None:  # from the others' size up, not from all of its own down: a
            # first contention would otherwise run ~20 steps of most of its sequences
            self.cap = max([1.0] + [a for u, a in asks.items() if u != busiest])
        self.cap = max(1.0, min(self.cap, asks[busiest]))
        caps = {t: max([self.cap] + [a for u, a in asks.items() if u != t]) for t in asks}
        if self.explore_every and (self.alone_s is None or self._draw.random()
                                   * self.explore_every * self.stretch < 1):
            caps[busiest], self._kind = -1.0, "alone"
        else:
            self._kind = "with"
        return StepShares(caps)

    def scheduled(self, now: float | None = None, ran: bool = True) -> None:
        """After each schedule: the gap since the previous one is that step's time (its
        forward, sampling and the worker loop around it); the cap follows the bound. An
        empty step (the others' requests could not start: no blocks) measures nothing."""
        now = time.perf_counter() if now is None else now
        if not ran:
            self._kind = ""
        if self._last is not None and now - self._last[0] < IDLE_S:
            gap, kind = now - self._last[0], self._last[1]
            if kind == "alone":  # (down at once, up as an average: a first measure taken
                # in a step that set a request up, ~2x a decode, held the bound loose ~30 steps)
                self.alone_s = gap if self.alone_s is None or gap < self.alone_s else \
                    _ewma(self.alone_s, gap, 0.3)
                roomy = self.with_s is not None and \
                    self.with_s < (1 + self.share / 2) * self.alone_s
                self.stretch = min(MAX_STRETCH, self.stretch * 2) if roomy else 1
            elif kind == "with" and self.alone_s is not None and self.cap is not None:
                self.with_s = _ewma(self.with_s, gap, 0.2)
                over = self.with_s > (1 + self.share) * self.alone_s
                self.cap *= SHRINK if over else GROW
        self._last = (now, self._kind) if self._kind else None


def survey(running: list[Request], tokens_to_compute: Callable[[Request], int] | None,
           max_tokens: int) -> tuple[dict[str, float], dict[str, list[Request]]]:
    """One walk over the running sequences: tenant -> the size of what its running ones
    would compute now (tenants with something to compute; none without
    ``tokens_to_compute``), and tenant -> its running sequences (in running order)."""
    out: dict[str, float] = {}
    groups: dict[str, list[Request]] = {}
    for req in running:
        t = req.sampling_params.tenant or ""
        g = groups.get(t)
        if g is None:
            g = groups[t] = []
        g.append(req)
        if tokens_to_compute is None:
            continue
        c = req.num_computed_tokens
        if c < len(req.prompt_token_ids) or req.num_output_placeholders:
            n = min(tokens_to_compute(req), max_tokens)
            if n <= 0:
                continue
            s = size(c, n)
        else:  # a decode without a token in flight: one token (inlined: per sequence)
            s = 1 + ROW_TOKENS + (c + 1) / CTX_PER_TOKEN
        out[t] = out.get(t, 0.0) + s
    return out, groups


def add_waiting(asks: dict[str, float], waiting: deque[Request], seats: Seats | None,
                free: bool, max_tokens: int) -> dict[str, float]:
    """``asks`` (``survey``'s) with the waiting requests that can get a seat: all of them
    while a seat is ``free``, else those of tenants under their part of the seats."""
    if not free and (seats is None or not seats.needy):
        return asks  # no seat for any of them (a walk over a held tenant's queue saved)
    for req in waiting:
        t = tenant_of(req)
        if free or t in seats.needy:  # type: ignore[union-attr]
            asks[t] = asks.get(t, 0.0) + size(0, min(req.num_tokens, max_tokens))
    return asks


class Seats:
    """One schedule's view of who holds the seats (``max_num_seqs``) and who waits."""

    def __init__(self, running: list[Request], waiting: list[Request] | deque[Request],
                 max_seqs: int, tenants: Counter[str] | None = None,
                 held: Counter[str] | None = None) -> None:
        # running sequences per tenant (``held``: counted already, else counted here)
        self.held = held if held is not None else Counter(tenant_of(r) for r in running)
        # tenants with a request waiting: from the scheduler's count of unfinished requests
        # per tenant when given (no walk over the waiting queue), else from the queue
        waiting_tenants = {t for t, c in tenants.items() if c > self.held[t]} \
            if tenants is not None else {tenant_of(r) for r in waiting}
        self.fair = max(1, max_seqs // max(1, len(set(self.held) | waiting_tenants)))
        self.full = len(running) >= max_seqs
        self.scarce = len(running) + len(waiting) > max_seqs  # not a seat for each
        self.needy = {t for t in waiting_tenants if self.held[t] < self.fair}

    def victims(self, running: list[Request], waiting: Iterable[Request]) -> list[Request]:
        """Running sequences to give their seats back now: one for each waiting request
        of a tenant under its part, taken from the tenant holding the most while it
        holds more than its part, its most recently admitted first."""
        if not self.full or not self.needy:
            return []
        wanted: Counter[str] = Counter()
        for r in waiting:
            t = tenant_of(r)
            if self.held[t] + wanted[t] < self.fair:
                wanted[t] += 1
        out: list[Request] = []
        held = Counter(self.held)
        for _ in range(sum(wanted.values())):
            t = max(held, key=held.__getitem__)
            if held[t] <= self.fair:
                break
            out.append(next(r for r in reversed(running)
                            if tenant_of(r) == t and all(r is not o for o in out)))
            held[t] -= 1
        return out

    def lets_others_first(self, req: Request) -> bool:
        """A waiting request whose tenant holds its part while another tenant under its
        part waits: it is passed over this step."""
        t = tenant_of(req)
        return self.scarce and self.held[t] >= self.fair and bool(self.needy - {t})

    def admitted(self, req: Request) -> None:
        t = tenant_of(req)
        self.held[t] += 1
        if self.held[t] >= self.fair:
            self.needy.discard(t)
