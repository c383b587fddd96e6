"""Token-history state for penalised requests, kept beside the persistent batch.

presence / frequency penalties need, per request, how often each token was output;
repetition penalty needs which tokens the prompt or output hold; the no-repeat n-gram
guard needs the output itself. Only requests that ask for one of them (see
``SamplingParams.penalised``) have an entry here, so a batch without them pays nothing.

The state is sparse: per request, the distinct token ids of its prompt and output and the
output count of each, in two growing arrays (a dict maps an id to its place):

    ids:      [ 17   4  903  52 ...]   prompt ids first, then new ids as they are sampled
    counts:   [  0   2    1   0 ...]   times output (0: prompt only)
    (and, with the n-gram guard, its index of the output: engine/sample/ngram_guard.py)

A step gathers the logits at every row's ids (one flat index over all penalised rows),
applies the penalties to those values and scatters them back: its cost follows the
tokens seen, not rows x vocabulary (a dense [rows, vocab] pass costs tens of ms a step on
a CPU for Qwen's 152k ids; these are a few thousand values).

Entries are keyed by request id, not by batch row, so the batch's row moves (condense)
touch nothing here. A request that (re)joins the batch (new, resumed after preemption,
imported with KV or migrated with its outputs) is rebuilt from its prompt + output
tokens; each sampled token then updates its entry.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from triptych.engine.sample.ngram_guard import NgramGuard
from triptych.engine.sample.sampling_params import SamplingParams


class _Entry:
    """One penalised request's distinct ids, their output counts, and its outputs."""

    def __init__(self, params: SamplingParams, prompt: list[int], outputs: list[int]) -> None:
        self.params = params
        uniq, counts = np.unique(np.asarray(outputs, dtype=np.int64), return_counts=True)
        only_prompt = np.setdiff1d(np.asarray(prompt, dtype=np.int64), uniq)
        ids = np.concatenate([only_prompt, uniq])
        self.n = len(ids)
        self.ids = np.zeros(max(16, 2 * self.n), dtype=np.int64)
        self.counts = np.zeros(len(self.ids), dtype=np.float32)
        self.ids[:self.n] = ids
        self.counts[len(only_prompt):self.n] = counts
        self.where = dict(zip(ids.tolist(), range(self.n)))  # id -> its place
        self.guard = NgramGuard(params.no_repeat_ngram_size, params.no_repeat_ngram_window,
                                params.no_repeat_ngram_whitelist, outputs) \
            if params.no_repeat_ngram_size > 0 else None

    def append(self, token_id: int) -> None:
        if self.guard is not None:
            self.guard.append(token_id)
        i = self.where.get(token_id)
        if i is None:
            if self.n == len(self.ids):  # double: amortised O(1)
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.where[token_id] = self.n
            self.ids[i] = token_id
            self.n += 1
        self.counts[i] += 1


class PenaltyState:
    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}

    def __bool__(self) -> bool:  # "any penalised request in the batch?" (the fast path)
        return bool(self.entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    # -- the batch's events ----------------------------------------------------------------
    def add(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
            output_token_ids: list[int]) -> None:
        """A request joins (or rejoins) the batch: its entry is rebuilt from its tokens."""
        self.entries.pop(request_id, None)
        if params.penalised:
            self.entries[request_id] = _Entry(params, prompt_token_ids, output_token_ids)

    def remove(self, request_id: str) -> None:
        self.entries.pop(request_id, None)

    def append(self, request_id: str, token_id: int) -> None:
        """A token was sampled for this request (no-op for unpenalised requests)."""
        e = self.entries.get(request_id)
        if e is not None:
            e.append(token_id)

    # -- sampling -------------------------------------------------------------------------
    def arrays(self, request_ids: list[str], vocab: int) -> tuple[np.ndarray, ...] | None:
        """The host side of this step's penalties for logits rows ``request_ids``
        (``PenaltyTensors``' fields as numpy arrays), or None when no row is penalised.

        Sparse: one (row, token) pair per distinct token a penalised row has seen, with its
        output count and the row's three penalty values, plus the (row, token) pairs the
        n-gram guard bans. Built from the host's token history: the device only gathers,
        computes and scatters."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.entries]
        if not rows:
            return None
        entries = [self.entries[request_ids[i]] for i in rows]
        counted = [(i, e) for i, e in zip(rows, entries)
                   if e.params.repetition_penalty != 1.0 or e.params.presence_penalty
                   or e.params.frequency_penalty]
        z_i, z_f = np.zeros(0, np.int64), np.zeros(0, np.float32)
        row = tok = z_i
        cnt = rep = freq = pres = z_f
        if counted:
            lens = np.array([e.n for _, e in counted])
            which = np.repeat(np.arange(len(counted)), lens)
            tok = np.concatenate([e.ids[:e.n] for _, e in counted])
            cnt = np.concatenate([e.counts[:e.n] for _, e in counted])
            row = np.array([i for i, _ in counted], dtype=np.int64)[which]
            keep = (tok >= 0) & (tok < vocab)  # (ids beyond the logits: nothing to change)
            tok, cnt, row, which = tok[keep], cnt[keep], row[keep], which[keep]

            def per(name: str) -> np.ndarray:
                return np.array([getattr(e.params, name) for _, e in counted],
                                dtype=np.float32)[which]

            rep, freq, pres = (per("repetition_penalty"), per("frequency_penalty"),
                               per("presence_penalty"))
        ban_row, ban_tok = z_i, z_i
        ngram = [(i, e) for i, e in zip(rows, entries) if e.params.no_repeat_ngram_size > 0]
        if ngram:
            bans = _ngram_bans(ngram, vocab)
            if bans is not None:
                ban_row, ban_tok = bans[0].numpy(), bans[1].numpy()
        return (row, tok, cnt.astype(np.float32), rep, freq, pres, ban_row, ban_tok)

    def apply(self, logits: torch.Tensor, request_ids: list[str]) -> torch.Tensor:
        """``logits`` [N, vocab] with the penalties of the penalised rows applied (a new
        tensor when any row is penalised; rows of other requests keep their values)."""
        host = self.arrays(request_ids, logits.shape[-1])
        if host is None:
            return logits
        return apply_penalties(logits, PenaltyTensors(
            *(torch.from_numpy(a).to(logits.device) for a in host)))


class PenaltyTensors(NamedTuple):
    """One step's penalties on the logits' device (``PenaltyState.arrays``, copied)."""

    row: torch.Tensor  # [P] int64: logits row of each (row, token) pair
    tok: torch.Tensor  # [P] int64: a token the row's prompt or output holds
    cnt: torch.Tensor  # [P] float32: times the row output it (0: prompt only)
    rep: torch.Tensor  # [P] float32: the row's repetition penalty
    freq: torch.Tensor  # [P] float32: frequency penalty
    pres: torch.Tensor  # [P] float32: presence penalty
    ban_row: torch.Tensor  # [Q] int64: (row, token) pairs the n-gram guard bans
    ban_tok: torch.Tensor  # [Q] int64


def apply_penalties(logits: torch.Tensor, pt: PenaltyTensors) -> torch.Tensor:
    """A new [N, vocab] tensor: penalised (row, token) logits changed, banned ones -inf.
    Gather, compute, scatter: no device value is read back."""
    out = logits.clone()
    if pt.row.numel():
        x = out[pt.row, pt.tok]
        # HF / vLLM: a seen token's logit is divided by the penalty when positive and
        # multiplied when negative (so it always becomes less likely for penalty > 1).
        x = torch.where(x > 0, x / pt.rep, x * pt.rep)
        # OpenAI's formula, over output tokens only (cnt is 0 for prompt-only ids).
        x = x - pt.freq * pt.cnt - pt.pres * (pt.cnt > 0)
        out[pt.row, pt.tok] = x
    if pt.ban_row.numel():
        out[pt.ban_row, pt.ban_tok] = float("-inf")
    return out


def _ngram_bans(ngram: list[tuple[int, _Entry]], vocab: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(batch rows, token ids) that would repeat an n-gram of the row's output, or None.
    Each row's guard (engine/sample/ngram_guard.py) answers from its index: the step's cost
    does not grow with a row's n, window or whitelist."""
    rows: list[int] = []
    toks: list[int] = []
    for row, e in ngram:
        assert e.guard is not None
        banned = e.guard.banned(vocab)
        rows += [row] * len(banned)
        toks += banned
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long), torch.tensor(toks, dtype=torch.long)
