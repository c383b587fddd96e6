"""GrammarState: the matchers of the batch's structured-output requests, and the step's mask.

Kept beside the penalty state on the persistent batch and keyed by request id, it follows
the same events: a request that joins (new, resumed after preemption, imported with its
first token from a prefill worker, migrated here with streamed tokens) gets a fresh matcher
into which its output tokens so far are replayed; each sampled token advances it; leaving
drops it. A step with no grammar row costs nothing (no bitmask, no call):

    logits [S, vocab] --(rows with a matcher: one batched fill)--> bitmask [S, words]
                      --apply_token_bitmask_inplace(indices=those rows)--> masked in place

Once a grammar is complete its matcher allows only the stop token (EOS), so the request
ends with finish_reason "stop"; ``max_tokens`` still cuts it short ("length").
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from triptych.engine.request import Request
from triptych.engine.structured.grammar_budget import GrammarBudget
from triptych.engine.structured.structured_params import StructuredOutputsParams

logger = logging.getLogger("triptych.grammar")


class GrammarState:
    """Request id -> xgrammar.GrammarMatcher for the batch's grammar rows."""

    def __init__(self) -> None:
        self.compile: Callable[[StructuredOutputsParams], Any] | None = None  # set by the
        # engine core (its GrammarCompiler): the batch itself knows no tokenizer
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, reused
        self._filler: Any = None  # xgrammar.BatchGrammarMatcher, made on first use
        self.dead: dict[str, str] = {}  # requests to end, and why (take_dead): a grammar
        # that allowed no token, or one over its share of the step
        # (engine/structured/grammar_budget.py)
        self.budget = GrammarBudget()
        self._accept_s: dict[str, float] = {}  # matcher updates since the last fill
        self.num_masked_steps = 0
        self.mask_seconds = 0.0  # time in fill + apply (bench/grammar.py reads it)

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, req: Request) -> None:
        """A request (re)joins: a fresh matcher, its output tokens replayed. Raises
        ValueError when a replayed token breaks the grammar (it cannot be resumed)."""
        spec = req.sampling_params.structured_outputs
        if spec is None:
            return
        import xgrammar as xgr

        assert self.compile is not None, "the engine core binds a compiler"
        matcher = xgr.GrammarMatcher(self.compile(spec))
        for tok in req.output_token_ids:
            if matcher.is_terminated():
                break  # (EOS ignored under min_tokens / ignore_eos: unconstrained from here)
            if not matcher.accept_token(tok):
                raise ValueError(f"request {req.request_id}: its output so far does not "
                                 f"follow its {spec.kind} constraint")
        self._matchers[req.request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._accept_s.pop(request_id, None)
        self.budget.forget(request_id)

    def accept(self, request_id: str, token_id: int) -> None:
        """The request sampled ``token_id``: advance its matcher."""
        m = self._matchers.get(request_id)
        if m is None or m.is_terminated():
            return
        t0 = time.perf_counter()
        ok = m.accept_token(token_id)
        spent = time.perf_counter() - t0
        self._accept_s[request_id] = self._accept_s.get(request_id, 0.0) + spent
        self.budget.spent(spent)
        if not ok:
            # Only reachable when a token was forced past the mask (min_tokens over EOS):
            # the constraint is dropped rather than the request failed.
            logger.warning("request %s: token %d breaks its grammar; unconstrained from here",
                           request_id, token_id)
            del self._matchers[request_id]

    def fill(self, request_ids: list[str], vocab: int) -> tuple[torch.Tensor, list[int]] | None:
        """This step's bitmask on the host: ([S, ceil(vocab / 32)] int32, the rows it
        constrains), or None when no row has a live matcher. Rows not listed are
        unconstrained (their words are left as they were: callers apply listed rows only)."""
        # request_ids: logits row -> request id
        rows = [(i, self._matchers[r]) for i, r in enumerate(request_ids)
                if r in self._matchers and not self._matchers[r].is_terminated()]
        if not rows:
            return None
        import xgrammar as xgr

        t0 = self.budget.start_step()
        n = len(request_ids)
        if self._bitmask is None or self._bitmask.shape[0] < n or \
                self._bitmask.shape[1] != (vocab + 31) // 32:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), vocab)
        bitmask = self._bitmask[:n]
        idx = [i for i, _ in rows]
        if self._filler is None:  # fills the rows on the worker's torch threads
            self._filler = xgr.BatchGrammarMatcher(max(1, torch.get_num_threads()))
        self._filler.batch_fill_next_token_bitmask([m for _, m in rows], bitmask, idx)
        self._charge(rows, bitmask, request_ids, time.perf_counter() - t0)
        # NOTE: a row that allows no token (a grammar with no way on from here) would
        # turn its logits into all -inf and the sampler's probabilities into NaN, failing
        # the step for the whole batch: the row is left unconstrained instead, and its
        # request is reported to the engine core (``take_dead``), which ends it
        empty = (bitmask[idx] == 0).all(dim=1).tolist()
        if any(empty):
            for i, e in zip(idx, empty):
                if e:
                    logger.warning("request %s: its grammar allows no next token; it is "
                                   "ended", request_ids[i])
                    self._end(request_ids[i], "the output constraint allows no further "
                                              "token: its grammar cannot be completed from here")
            idx = [i for i, e in zip(idx, empty) if not e]
        idx = [i for i in idx if request_ids[i] in self._matchers]  # (ended rows: unmasked)
        self.num_masked_steps += 1
        self.mask_seconds += time.perf_counter() - t0
        return (bitmask, idx) if idx else None

    def _charge(self, rows: list[tuple[int, Any]], bitmask: torch.Tensor,
                request_ids: list[str], batch_s: float) -> None:
        """Hold this step's grammar work against the budget: when the batch's is over the
        allowance, time each row's fill alone (filling it again: same mask) and end the
        rows that stay over it (engine/structured/grammar_budget.py)."""
        accepted = sum(self._accept_s.values())
        self.budget.spent(batch_s)
        if batch_s + accepted <= self.budget.allowance_s:
            self._accept_s.clear()
            self.budget.judge({request_ids[i]: 0.0 for i, _ in rows})
            return
        costs = {}
        for i, m in rows:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, i)
            costs[request_ids[i]] = time.perf_counter() - t0 + \
                self._accept_s.get(request_ids[i], 0.0)
        self._accept_s.clear()
        for rid, cost in self.budget.judge(costs).items():
            why = self.budget.message(cost)
            logger.warning("request %s: %s; it is ended", rid, why)
            self._end(rid, why)

    def _end(self, request_id: str, why: str) -> None:
        self.dead[request_id] = why
        del self._matchers[request_id]
        self.budget.forget(request_id)

    def take_dead(self) -> dict[str, str]:
        """The requests to end since the last call, and why: a grammar that allowed no
        token, or one over its share of the step. Their rows were sampled unconstrained:
        the engine core drops that token and ends them with the reason."""
        dead, self.dead = self.dead, {}
        return dead

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> torch.Tensor:
        """Mask the logits of the grammar rows (``fill`` + ``apply_bitmask``) and return
        them (in place on the host)."""
        filled = self.fill(request_ids, logits.shape[-1])
        if filled is None:
            return logits
        bitmask, idx = filled
        t0 = time.perf_counter()
        out = apply_bitmask(logits, bitmask, torch.tensor(idx, dtype=torch.long))
        self.mask_seconds += time.perf_counter() - t0
        return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
                  ) -> torch.Tensor:
    """Tokens whose bit is 0 in their row's mask set to -inf, for the listed rows.

    On the host xgrammar's kernel masks in place; on a device the bits are unpacked with
    tensor ops (no host round trip, whatever packages the device's machine has).
    bitmask: [S, ceil(vocab / 32)] int32 on the logits' device; rows: [n] int64."""
    # logits: [S, vocab] float32
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab,
                                        indices=rows.tolist())
        return logits
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.index_select(0, rows)  # [n, W]
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :vocab]
    sub = logits.index_select(0, rows).masked_fill(allowed == 0, float("-inf"))
    return logits.index_copy(0, rows, sub)
