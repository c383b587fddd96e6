"""Token-history state for penalised requests, kept beside the persistent batch.

presence / frequency penalties need, per request, how often each token was output;
repetition penalty needs which tokens the prompt or output hold; the no-repeat n-gram
guard needs the output itself. Only requests that ask for one of them (see
``SamplingParams.penalised``) get a slot here, so a batch without them pays nothing:

    slot:              0                      1
    counts[slot]:      output count per id    (int32, [slots, vocab])
    prompt[slot]:      prompt holds the id    (bool,  [slots, vocab])
    outputs[slot]:     output ids in order    (for the n-gram guard)

Slots are keyed by request id, not by batch row, so the batch's row moves (condense)
touch nothing here. A request that (re)joins the batch (new, resumed after preemption,
imported with KV or migrated with its outputs) is rebuilt from its prompt + output
tokens; each sampled token then adds one count. The vocabulary width is learnt from the
first logits (the batch does not know it), so rows are filled lazily ("dirty" slots).

Every op over the vocabulary is one tensor op over all penalised rows of a step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triptych.engine.sampling_params import SamplingParams


@dataclass
class _Entry:
    slot: int
    params: SamplingParams
    prompt: list[int]
    outputs: list[int]
    dirty: bool = True  # counts/prompt rows not yet built (or vocab width changed)


class PenaltyState:
    def __init__(self, capacity: int = 4) -> None:
        self.entries: dict[str, _Entry] = {}
        self._free: list[int] = []
        self._next = 0
        self.vocab = 0
        self.counts = torch.zeros((capacity, 0), dtype=torch.int32)
        self.prompt = torch.zeros((capacity, 0), dtype=torch.bool)

    def __bool__(self) -> bool:  # "any penalised request in the batch?" (the fast path)
        return bool(self.entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    # -- the batch's events ----------------------------------------------------------------
    def add(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
            output_token_ids: list[int]) -> None:
        """A request joins (or rejoins) the batch: its state is rebuilt from its tokens."""
        self.remove(request_id)
        if not params.penalised:
            return
        slot = self._free.pop() if self._free else self._take()
        self.entries[request_id] = _Entry(slot, params, list(prompt_token_ids),
                                          list(output_token_ids))

    def remove(self, request_id: str) -> None:
        e = self.entries.pop(request_id, None)
        if e is not None:
            self._free.append(e.slot)

    def append(self, request_id: str, token_id: int) -> None:
        """A token was sampled for this request (no-op for unpenalised requests)."""
        e = self.entries.get(request_id)
        if e is None:
            return
        e.outputs.append(token_id)
        if not e.dirty and 0 <= token_id < self.vocab:
            self.counts[e.slot, token_id] += 1

    def _take(self) -> int:
        slot = self._next
        self._next += 1
        if slot >= self.counts.shape[0]:  # double: amortised O(1) growth
            rows = 2 * self.counts.shape[0]
            self.counts = _grow(self.counts, rows)
            self.prompt = _grow(self.prompt, rows)
        return slot

    def _ensure_vocab(self, vocab: int) -> None:
        if vocab != self.vocab:  # first logits (or another width): rebuild every row
            self.vocab = vocab
            self.counts = torch.zeros((self.counts.shape[0], vocab), dtype=torch.int32)
            self.prompt = torch.zeros((self.prompt.shape[0], vocab), dtype=torch.bool)
            for e in self.entries.values():
                e.dirty = True

    def _build(self, entries: list[_Entry]) -> None:
        """Fill the rows of (re)joined requests from their tokens, all in one scatter."""
        dirty = [e for e in entries if e.dirty]
        if not dirty:
            return
        slots = torch.tensor([e.slot for e in dirty])
        self.counts[slots] = 0
        self.prompt[slots] = False
        v = self.vocab
        out_rows = [(e.slot, t) for e in dirty for t in e.outputs if 0 <= t < v]
        if out_rows:
            idx = torch.tensor(out_rows)
            flat = self.counts.view(-1)
            flat.index_add_(0, idx[:, 0] * v + idx[:, 1],
                            torch.ones(len(out_rows), dtype=torch.int32))
        p_rows = [(e.slot, t) for e in dirty for t in e.prompt if 0 <= t < v]
        if p_rows:
            idx = torch.tensor(p_rows)
            self.prompt[idx[:, 0], idx[:, 1]] = True
        for e in dirty:
            e.dirty = False

    # -- sampling -------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, request_ids: list[str]) -> torch.Tensor:
        """``logits`` [N, vocab] with the penalties of the penalised rows applied (a new
        tensor when any row changes; rows of other requests are left as they are)."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.entries]
        if not rows:
            return logits
        self._ensure_vocab(logits.shape[-1])
        entries = [self.entries[request_ids[i]] for i in rows]
        self._build(entries)
        out = logits.clone()
        idx = torch.tensor(rows)
        slots = torch.tensor([e.slot for e in entries])
        x = out[idx]
        counts = self.counts[slots]
        rep = torch.tensor([e.params.repetition_penalty for e in entries])
        if bool((rep != 1.0).any()):
            # HF / vLLM: a seen token's logit is divided by the penalty when positive and
            # multiplied when negative (so it always becomes less likely for penalty > 1).
            seen = (counts > 0) | self.prompt[slots]
            r = rep[:, None]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        freq = torch.tensor([e.params.frequency_penalty for e in entries])[:, None]
        pres = torch.tensor([e.params.presence_penalty for e in entries])[:, None]
        if bool((freq != 0).any() or (pres != 0).any()):
            # OpenAI's formula, over output tokens only.
            x = x - freq * counts - pres * (counts > 0)
        ngram = [(j, e) for j, e in enumerate(entries) if e.params.no_repeat_ngram_size > 0]
        if ngram:
            x = x.masked_fill(_ngram_bans(ngram, len(entries), x.shape[-1]), float("-inf"))
        out[idx] = x
        return out


def _grow(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
    out[:t.shape[0]] = t
    return out


def _ngram_bans(ngram: list[tuple[int, _Entry]], num_rows: int, vocab: int) -> torch.Tensor:
    """[num_rows, vocab] bool: tokens that would repeat an n-gram of the row's output.

    A token t is banned when (last n-1 output tokens, t) already occurs among the n-grams
    that start in the row's window. Rows with the same n are checked together: their
    windows are left-padded with -1 into one [R, L] tensor and every n-gram of every row
    is compared to that row's prefix in one broadcast.
    """
    banned = torch.zeros((num_rows, vocab + 1), dtype=torch.bool)  # column `vocab`: a sink
    by_n: dict[int, list[tuple[int, list[int], _Entry]]] = {}
    for j, e in ngram:
        n, w = e.params.no_repeat_ngram_size, e.params.no_repeat_ngram_window
        toks = e.outputs
        if len(toks) < n or (w and w < n):
            continue  # no complete n-gram (in the window) yet
        # Only n-grams lying inside the last w tokens count (vLLM's window_size); the
        # prefix (the last n-1 tokens) lies inside them too.
        span = toks[-w:] if w else toks
        by_n.setdefault(n, []).append((j, span, e))
    for n, group in by_n.items():
        length = max(len(s) for _, s, _ in group)
        seqs = torch.full((len(group), length), -1, dtype=torch.long)
        for r, (_, s, _) in enumerate(group):
            seqs[r, length - len(s):] = torch.tensor(s)
        grams = seqs.unfold(1, n, 1)  # [R, L-n+1, n]: every n-gram of every row
        prefix = seqs[:, length - (n - 1):]  # [R, n-1]
        # (padding is on the left: a gram whose first id is real is real throughout)
        hit = (grams[:, :, :n - 1] == prefix[:, None, :]).all(-1) & (grams[:, :, 0] >= 0)
        last = torch.where(hit, grams[:, :, -1], torch.full_like(grams[:, :, -1], vocab))
        last = last.clamp(max=vocab)
        rows = torch.tensor([j for j, _, _ in group])
        banned[rows] = banned[rows].scatter(1, last, True)
        for j, _, e in group:
            wl = [t for t in e.params.no_repeat_ngram_whitelist or [] if 0 <= t < vocab]
            if wl:
                banned[j, wl] = False
    return banned[:, :vocab]
