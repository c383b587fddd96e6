"""How much grammar work one structured-output request may cost a step.

A grammar's matcher can cost more per token as the output grows: an ambiguous EBNF grammar
(``s ::= s s s | s s | "a" | ""``) compiles at once and fills its first masks in
microseconds, then ~300 ms a token by token 170. That work runs inside the batch step, so
every request in the batch waits for it. Each step, the grammar rows' work (the mask fill,
and the matcher updates of the tokens they took) is timed against an allowance:

    allowance = --max-grammar-step-ms                   when set
              = max(0.25 ms, half the step's own time)   otherwise (auto)

where the step's own time is a running average of the time between two fills less the
grammar work in it (the forward, the sampler, the bookkeeping). Only when the whole batch's
grammar work is over the allowance are the rows timed one by one; a row over it in
``STRIKES`` steps running is ended, with an error naming the flag. With the automatic
allowance no request's grammar can make its batch-mates' step more than about 1.5x as long
as it would be without it (the bound tenant shares keep by default, engine/tenant_share.py).
The floor is for steps of a tiny model: a mask over a 272-token vocabulary takes
microseconds, one over 152k ~0.5 ms, beside steps of several ms.
"""
from __future__ import annotations

import time

STRIKES = 3  # steps running over the allowance before a request is ended (noise: one
# slow step on a busy host must not end a request)
FLOOR_S = 0.25e-3  # the automatic allowance never goes below this
AUTO_SHARE = 0.5  # the automatic allowance: this share of the step's own time
_IDLE_S = 1.0  # a gap this long between two fills is an idle engine, not a step


class GrammarBudget:
    """The allowance and each grammar request's strikes."""

    def __init__(self, fixed_s: float = 0.0) -> None:
        self.fixed_s = fixed_s  # --max-grammar-step-ms / 1000 (0: auto)
        self.step_s = 0.0  # running average of a step's time without grammar work
        self._last_fill: float | None = None
        self._grammar_s = 0.0  # grammar work since the last fill
        self.strikes: dict[str, int] = {}

    @property
    def allowance_s(self) -> float:
        return self.fixed_s or max(FLOOR_S, AUTO_SHARE * self.step_s)

    def start_step(self) -> float:
        """Called at each fill: learn the step's own time from the gap since the last."""
        now = time.perf_counter()
        if self._last_fill is not None:
            gap = now - self._last_fill
            if gap < _IDLE_S:
                own = max(0.0, gap - self._grammar_s)
                self.step_s = own if not self.step_s else 0.8 * self.step_s + 0.2 * own
        self._last_fill, self._grammar_s = now, 0.0
        return now

    def spent(self, seconds: float) -> None:
        self._grammar_s += seconds

    def judge(self, costs: dict[str, float]) -> dict[str, float]:
        """Rows' grammar work this step (request id -> seconds) -> those to end now."""
        limit, out = self.allowance_s, {}
        for rid, cost in costs.items():
            if cost > limit:
                self.strikes[rid] = self.strikes.get(rid, 0) + 1
                if self.strikes[rid] >= STRIKES:
                    out[rid] = cost
            else:
                self.strikes.pop(rid, None)
        return out

    def forget(self, rid: str) -> None:
        self.strikes.pop(rid, None)

    def message(self, cost_s: float) -> str:
        flag = f"--max-grammar-step-ms {self.fixed_s * 1000:g}" if self.fixed_s else \
            "--max-grammar-step-ms: auto, half the step's own time"
        return (f"the output constraint costs {cost_s * 1000:.1f} ms of grammar work per "
                f"token, more than its share of a step ({self.allowance_s * 1000:.1f} ms, "
                f"{flag}) in {STRIKES} steps running: its grammar is too ambiguous to follow "
                "at serving speed; simplify it")


__all__ = ["FLOOR_S", "STRIKES", "GrammarBudget"]
