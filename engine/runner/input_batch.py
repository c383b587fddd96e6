"""InputBatch: the runner's per-request state, kept in preallocated arrays across steps.

One row per request in the current step (rows ``[0, num_reqs)`` are dense after
``condense``). A request's row holds its token ids, counters, M-RoPE delta and block
table; rows are written when a request joins, grow by a token or a block per step, and
are freed when it leaves. A step's flat inputs are then a handful of vectorised numpy ops
over these arrays, not per-request tensors:

    row:            0              1                        2
    token_ids:      [p p p o o]    [p p p p p p p p]        [p p o]
    num_computed:   4              2                        2
    num_scheduled:  1 (decode)     6 (prefill chunk 2..8)   1 (decode)
    flat tokens:    [o]            [p p p p p p]            [o]
    req_idx:        0              1 1 1 1 1 1              2
    pos:            4              2 3 4 5 6 7              2

    block_table[row, pos // block_size] * block_size + pos % block_size = slot of a token

Bookkeeping only: nothing here touches torch tensors of the model or the KV cache. The
token history of penalised requests (engine/sample/penalties.py) follows the same join / leave /
append events, keyed by request id so that row moves leave it alone. Each row's sampling
parameters (temperature, top-k, top-p, min-p) are written when its request joins and move
with the row: a step takes the sampled rows' values with one gather (``sampling``).

A row may have one token in flight (async scheduling: the step that samples it has not
been read back): ``num_tokens`` counts the known ids only, the step's ``in_flight`` says
which rows have one more, and its input id (at position ``num_tokens``) is written on the
device by the runner. The step's rows come decodes first (``decodes_first``), so attention
can run the decode rows of a mixed step through the decode kernel as one slice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from triptych.engine.request import Request
from triptych.engine.sample.penalties import PenaltyState
from triptych.engine.sample.sampler import SamplingArrays, sampling_arrays
from triptych.engine.structured.grammar import GrammarState

# per-row arrays that move with their row (dtype of each)
_ROW_ARRAYS = {"num_tokens": np.int64, "num_computed": np.int64, "num_prompt": np.int64,
               "mrope_delta": np.int64, "num_blocks": np.int64, "temperature": np.float32,
               "top_k": np.int64, "top_p": np.float32, "min_p": np.float32}


@dataclass
class StepInputs:
    """One step's flat inputs (host numpy arrays, T tokens over B rows)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [3, T] int64: M-RoPE (temporal, height, width)
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32 (contiguous copy)
    cu_seqlens_q: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32: context length after this step
    max_query_len: int
    sample_rows: np.ndarray  # [S] int64: rows whose chunk reaches the end of known tokens
    logits_index: np.ndarray  # [S + P] int64: flat index of each sampled row's last token,
    # then of every prompt position whose logprobs a request asked for (prompt_logprobs)
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)  # (row, first
    # position, count) of those P positions, in order


def _grow(a: np.ndarray, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    """``a`` zero-padded to at least (rows, cols); doubling keeps growth amortised O(1)."""
    r = max(a.shape[0], rows or 0)
    if r > a.shape[0]:
        r = max(r, 2 * a.shape[0])
    shape = (r,) + a.shape[1:]
    if cols is not None and a.ndim == 2 and cols > a.shape[1]:
        shape = (r, max(cols, 2 * a.shape[1]))
    if shape == a.shape:
        return a
    out = np.zeros(shape, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


class InputBatch:
    def __init__(self, block_size: int, max_reqs: int = 8, max_tokens: int = 256,
                 max_blocks: int = 16) -> None:
        self.block_size = block_size
        self.reqs: list[Request | None] = [None] * max_reqs  # row -> request (None = hole)
        self.index: dict[str, int] = {}  # request id -> row
        self.token_ids = np.zeros((max_reqs, max_tokens), dtype=np.int64)
        # num_tokens: ids known (prompt + outputs); num_computed: ids whose KV is cached;
        # num_prompt, mrope_delta, num_blocks; the row's sampling parameters
        for name, dtype in _ROW_ARRAYS.items():
            setattr(self, name, np.zeros(max_reqs, dtype=dtype))
        self.block_table = np.zeros((max_reqs, max_blocks), dtype=np.int32)
        self.num_reqs = 0  # rows in use, holes included, until condense()
        self._holes: list[int] = []
        self.penalties = PenaltyState()  # token counts of requests with penalties
        self.grammars = GrammarState()  # matchers of structured-output requests
        # running requests that sit a step out (tenant shares, the token budget): their row
        # is freed, their matcher and penalty counts kept, so rejoining replays nothing
        self.resting: dict[str, tuple[Request, int]] = {}  # id -> (request, its ids known)
        self._sampling_memo: tuple[list[Request], SamplingArrays] | None = None  # (sampling)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.index

    # -- joining and leaving --------------------------------------------------------------
    def add(self, req: Request, block_ids: list[int], num_computed: int | None = None) -> int:
        """Write a request's row (new, resumed after preemption, or imported with KV).
        ``num_computed``: its tokens with KV before this step (default: the request's
        count; the scheduler counts a scheduled step's tokens as computed already)."""
        assert req.request_id not in self.index, f"{req.request_id} is already in the batch"
        rested = self.resting.pop(req.request_id, None)
        if rested is not None and not (rested[0] is req and rested[1] == req.num_tokens):
            self.penalties.remove(req.request_id)  # (its tokens changed meanwhile: rebuilt)
            self.grammars.remove(req.request_id)
            rested = None
        if rested is None:
            # A fresh matcher with the output so far replayed (first: it may refuse it)
            self.grammars.add(req)
        if self._holes:
            row = min(self._holes)
            self._holes.remove(row)
        else:
            row = self.num_reqs
            self.num_reqs += 1
            self._ensure_rows(self.num_reqs)
        n = req.num_tokens
        self._ensure_tokens(n + 1)
        self.token_ids[row, :req.num_prompt_tokens] = req.prompt_token_ids
        self.token_ids[row, req.num_prompt_tokens:n] = req.output_token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = req.num_computed_tokens if num_computed is None else num_computed
        self.num_prompt[row] = req.num_prompt_tokens
        self.mrope_delta[row] = req.mrope_delta
        self.num_blocks[row] = 0
        sp = req.sampling_params
        self.temperature[row], self.top_k[row] = sp.temperature, sp.top_k
        self.top_p[row], self.min_p[row] = sp.top_p, sp.min_p
        self.reqs[row] = req
        self.index[req.request_id] = row
        self.set_blocks(row, block_ids)
        # (Re)joining rebuilds the penalty state from the request's own tokens: preemption,
        # KV import and migration all come through here (a rested request keeps its own).
        if rested is None:
            self.penalties.add(req.request_id, req.sampling_params, req.prompt_token_ids,
                               req.output_token_ids)
        return row

    def rest(self, request_id: str) -> None:
        """Free a running request's row for a step or more, keeping its matcher and
        penalty counts (``add`` takes them back while its tokens are the ones it left with)."""
        row = self.index.pop(request_id)
        req = self.reqs[row]
        self.resting[request_id] = (req, int(self.num_tokens[row]))
        self.reqs[row] = None
        self._holes.append(row)

    def rested_token(self, req: Request, token_id: int) -> None:
        """A token of a step it ran before resting (async scheduling) arrived."""
        rested = self.resting.get(req.request_id)
        if rested is None or rested[0] is not req:
            return
        self.resting[req.request_id] = (req, rested[1] + 1)
        self.penalties.append(req.request_id, token_id)
        self.grammars.accept(req.request_id, token_id)

    def remove(self, request_id: str) -> int | None:
        """Free a request's row (finished, aborted, preempted or not scheduled)."""
        row = self.index.pop(request_id, None)
        if row is None:
            if self.resting.pop(request_id, None) is not None:
                self.penalties.remove(request_id)
                self.grammars.remove(request_id)
            return None
        self.penalties.remove(request_id)
        self.grammars.remove(request_id)
        self.reqs[row] = None
        self._holes.append(row)
        return row

    def condense(self) -> None:
        """Fill holes with the last rows so rows ``[0, len)`` are dense.

        The lowest hole takes the highest live row, repeatedly (as vLLM's input batch):
        rows below the first hole keep their place, so a steady decode batch moves no data.
        """
        holes = sorted(self._holes)
        self._holes = []
        last = self.num_reqs - 1
        for hole in holes:
            while last >= 0 and self.reqs[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move(last, hole)
            last -= 1
        self.num_reqs = len(self.index)

    def decodes_first(self, num_scheduled: np.ndarray) -> None:
        """Reorder rows ``[0, len)`` so those computing one token come first (vLLM's
        reorder of the persistent batch): a swap for each decode behind a longer row, none
        in a steady decode batch. ``num_scheduled`` (per row) is permuted with them."""
        i, j = 0, len(num_scheduled) - 1
        while i < j:
            if num_scheduled[i] == 1:
                i += 1
            elif num_scheduled[j] != 1:
                j -= 1
            else:
                self._swap(i, j)
                num_scheduled[[i, j]] = num_scheduled[[j, i]]

    def _swap(self, a: int, b: int) -> None:
        self.token_ids[[a, b]] = self.token_ids[[b, a]]
        self.block_table[[a, b]] = self.block_table[[b, a]]
        for name in _ROW_ARRAYS:
            arr = getattr(self, name)
            arr[[a, b]] = arr[[b, a]]
        self.reqs[a], self.reqs[b] = self.reqs[b], self.reqs[a]
        for row in (a, b):
            self.index[self.reqs[row].request_id] = row

    def _move(self, src: int, dst: int) -> None:
        req = self.reqs[src]
        assert req is not None
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for name in _ROW_ARRAYS:
            a = getattr(self, name)
            a[dst] = a[src]
        self.reqs[dst], self.reqs[src] = req, None
        self.index[req.request_id] = dst

    # -- growing ----------------------------------------------------------------------------
    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append the blocks the KV manager gave this request since the last step.

        NOTE: a running request's block list only grows; a preempted request loses its
        blocks and comes back through ``add`` (the runner checks num_computed_tokens)."""
        have, want = int(self.num_blocks[row]), len(block_ids)
        if want > have:
            if want > self.block_table.shape[1]:
                self.block_table = _grow(self.block_table, cols=want)
            self.block_table[row, have:want] = block_ids[have:]
            self.num_blocks[row] = want

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self._ensure_tokens(n + 2)
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        if self.penalties:
            self.penalties.append(self.reqs[row].request_id, token_id)
        if self.grammars:
            self.grammars.accept(self.reqs[row].request_id, token_id)

    def _ensure_rows(self, rows: int) -> None:
        if rows <= len(self.reqs):
            return
        self.token_ids = _grow(self.token_ids, rows=rows)
        for name in _ROW_ARRAYS:
            setattr(self, name, _grow(getattr(self, name), rows=rows))
        self.block_table = _grow(self.block_table, rows=rows)
        self.reqs += [None] * (self.token_ids.shape[0] - len(self.reqs))

    def _ensure_tokens(self, n: int) -> None:
        if n > self.token_ids.shape[1]:
            self.token_ids = _grow(self.token_ids, cols=n)

    # -- one step -------------------------------------------------------------------------
    def prepare(self, num_scheduled: np.ndarray, in_flight: np.ndarray | None = None
                ) -> StepInputs:
        """Flat inputs for rows ``[0, B)`` computing ``num_scheduled[row]`` tokens each;
        ``in_flight[row]``: 1 where the row's last token is still on the device (its input
        id here is a stale value the runner overwrites on the device)."""
        b = len(num_scheduled)
        assert b == self.num_reqs and not self._holes, "condense() before prepare()"
        bs = self.block_size
        n = num_scheduled.astype(np.int64)
        cu = np.cumsum(n)
        start = self.num_computed[:b]
        self._ensure_tokens(int((start + n).max()) + 1)
        if int(cu[-1]) == b:  # pure decode: one token per row, no repeat needed
            req_idx = np.arange(b)
            pos = start.copy()
        else:
            req_idx = np.repeat(np.arange(b), n)
            pos = np.arange(int(cu[-1])) - np.repeat(cu - n, n) + start[req_idx]
        input_ids = self.token_ids[req_idx, pos]
        slot_mapping = self.block_table[req_idx, pos // bs].astype(np.int64) * bs + pos % bs
        positions = np.broadcast_to(pos + self.mrope_delta[req_idx], (3, len(pos))).copy()
        # Prompt tokens of image prompts take their M-RoPE ids from the request.
        for row in np.flatnonzero(start < self.num_prompt[:b]).tolist():
            req = self.reqs[row]
            if req is not None and req.mm_items and req.mrope_positions is not None:
                lo, hi = int(start[row]), min(int(start[row] + n[row]), int(self.num_prompt[row]))
                first = int(cu[row] - n[row])
                positions[:, first:first + hi - lo] = req.mrope_positions[:, lo:hi]
        seq_lens = start + n
        max_blocks = int(-(-int(seq_lens.max()) // bs))
        known = self.num_tokens[:b] if in_flight is None else self.num_tokens[:b] + in_flight
        sample_rows = np.flatnonzero(seq_lens == known)
        logits_index = cu[sample_rows] - 1
        prompt_rows, extra = self._prompt_logprob_rows(start, n, cu)
        if extra:
            logits_index = np.concatenate([logits_index, *extra])
        return StepInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            block_tables=np.ascontiguousarray(self.block_table[:b, :max_blocks]),
            cu_seqlens_q=np.concatenate(([0], cu)).astype(np.int32),
            seq_lens=seq_lens.astype(np.int32), max_query_len=int(n.max()),
            sample_rows=sample_rows, logits_index=logits_index, prompt_rows=prompt_rows)

    def _prompt_logprob_rows(self, start: np.ndarray, n: np.ndarray, cu: np.ndarray
                             ) -> tuple[list[tuple[int, int, int]], list[np.ndarray]]:
        """Positions t of this step whose logits predict prompt token t + 1, for requests
        that asked for prompt logprobs: (row, first t, count) and their flat indices."""
        rows, flat = [], []
        for row in np.flatnonzero(start < self.num_prompt[:len(n)]).tolist():
            req = self.reqs[row]
            if req is None or req.sampling_params.prompt_logprobs is None:
                continue
            lo = int(start[row])
            hi = min(lo + int(n[row]), int(self.num_prompt[row]) - 1)
            if hi > lo:
                first = int(cu[row] - n[row])
                rows.append((row, lo, hi - lo))
                flat.append(np.arange(first, first + hi - lo))
        return rows, flat

    def sampling(self, rows: np.ndarray, vocab: int) -> SamplingArrays:
        """The host arrays that sample ``rows`` (in that order) this step: the previous
        step's when its rows held the same requests in the same order and no request has
        penalties (whose counts change every step); a decode batch's rows mostly do."""
        reqs = [self.reqs[r] for r in rows.tolist()]
        memo = self._sampling_memo
        if memo is not None and not self.penalties and len(memo[0]) == len(reqs) and \
                all(a is b for a, b in zip(memo[0], reqs)):
            return memo[1]
        host = sampling_arrays(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                               self.min_p[rows], [r.sampling_params for r in reqs], vocab,
                               self.penalties, [r.request_id for r in reqs])
        self._sampling_memo = None if self.penalties else (reqs, host)
        return host

    def advance(self, num_scheduled: np.ndarray) -> None:
        """After a step: the scheduled tokens' KV is in the cache."""
        self.num_computed[:len(num_scheduled)] += num_scheduled

    def check_integrity(self) -> None:
        """Row bookkeeping invariants (tests and debugging)."""
        live = [r for r in range(self.num_reqs) if self.reqs[r] is not None]
        assert sorted(self.index.values()) == live, (self.index, live)
        assert set(self._holes) | set(live) == set(range(self.num_reqs))
        for rid, row in self.index.items():
            req = self.reqs[row]
            assert req is not None and req.request_id == rid
            assert self.num_computed[row] <= self.num_tokens[row] + 1  # (+ one in flight)
            assert self.num_blocks[row] * self.block_size >= self.num_computed[row]
