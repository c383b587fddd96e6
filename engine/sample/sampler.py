"""Sampler: logits of the last token of each finished chunk -> next token ids, on the
device the logits are on.

Every step is batched tensor work on the logits' device; nothing reads the device back.
What differs per request reaches the sampler as a ``SamplingTensors``: per-row parameters
taken from the persistent batch's arrays (written once, when a request joins), the sparse
(row, token) lists of its logit biases and penalties, and the grammar bitmask, all built on
the host and carried to the device in the step's one copy (engine/device/device_io.py). In
vLLM's order:

    logits --logit_bias--> --penalties (engine/sample/penalties.py)--> --grammar mask-->
        greedy rows: argmax                 (the platform's: a C++ one on the CPU)
        random rows: / temperature, min-p, top-k, top-p, then one draw per row: the
                     inverse CDF at a uniform u (a seeded request draws its u from its
                     own generator, so its tokens do not depend on its batch-mates); rows
                     with a temperature only, on the CPU: the platform's ``draw``, one
                     C++ call for all of them (kernels/cpu/panel_gemm.py)

Logprobs are those of the model's logits as given (after a grammar mask, before bias and
penalties: vLLM's default is the raw logits), top-k per row plus the sampled token, as
device tensors the runner fetches with the ids in one copy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from triptych.engine.sample.penalties import PenaltyState, PenaltyTensors, apply_penalties
from triptych.engine.sample.sampling_params import SamplingParams

Argmax = Callable[[torch.Tensor], torch.Tensor]  # [N, V] -> [N] int64
# (logits [S, V], rows [R], temperature [R], u [R] fp64, ids [S]) -> ids with the rows drawn
# in place, or None where it does not apply: the platform's one-call draw of plain random
# rows (the torch ops of ``_draw`` otherwise)
Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                torch.Tensor | None]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # per row: top-k (+ sampled) token -> logprob


@dataclass
class SamplingTensors:
    """One step's sampling inputs for S rows, on the logits' device (host sizes aside).

    Row order is the logits' order. Fields that no row needs are None: a greedy batch
    without logprobs, bias, penalties or grammar carries nothing but ``greedy``."""

    greedy: bool  # every row greedy (host)
    random_rows: torch.Tensor | None = None  # [R] int64: rows drawn at random
    temperature: torch.Tensor | None = None  # [R] float32 (of the random rows)
    min_p: torch.Tensor | None = None  # [R] float32, or None: no row uses it
    top_k: torch.Tensor | None = None  # [R] int64 (0: all), or None
    top_k_max: int = 0  # the largest top_k (host: the topk launch size)
    top_p: torch.Tensor | None = None  # [R] float32 (1: all), or None
    seeded: list[tuple[int, torch.Generator]] | None = None  # (index in the R rows, its
    # request's generator): drawn apart from the rest
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    penalties: PenaltyTensors | None = None
    logprob_rows: torch.Tensor | None = None  # [W] int64: rows asking for logprobs
    logprob_k: int = 0  # the largest k asked (host)
    logprob_ids: torch.Tensor | None = None  # [W, M] int64: logprob_token_ids per asking row


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, argmax: Argmax = torch_argmax,
                 draw: Draw | None = None) -> None:
        self.seed = seed
        self.argmax = argmax  # the platform's (engine/device/platform.py)
        self.draw = draw  # the platform's, for rows with a temperature only (or None)
        self._defaults: dict[torch.device, torch.Generator] = {}
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def generator(self, request_id: str, params: SamplingParams, device: torch.device
                  ) -> torch.Generator | None:
        """The request's own generator (seeded requests), made on first use; None for the
        others (they share the sampler's)."""
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)  # (one sampler serves one device)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device).manual_seed(params.seed)
        return gen

    def _default(self, device: torch.device) -> torch.Generator:
        gen = self._defaults.get(device)
        if gen is None:
            gen = self._defaults[device] = torch.Generator(device).manual_seed(self.seed)
        return gen

    # -- the step -----------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, st: SamplingTensors
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Token ids [S] int64 and, when asked, logprob tensors (top values [W, k], their
        ids [W, k], the sampled token's [W]): all on the logits' device."""
        # logits: [S, vocab] float32
        x = logits
        if st.bias is not None:
            rows, ids, vals = st.bias
            x = x.index_put((rows, ids), vals, accumulate=True)
        if st.penalties is not None:
            x = apply_penalties(x, st.penalties)
        ids = self.argmax(x)
        if not st.greedy and st.random_rows is not None and st.random_rows.numel():
            drawn = None
            if self.draw is not None and st.min_p is None and st.top_k is None and \
                    st.top_p is None:
                assert st.temperature is not None
                drawn = self.draw(x, st.random_rows, st.temperature,
                                  self._uniforms(st, x.device)[:, 0], ids)
            ids = drawn if drawn is not None else \
                ids.index_copy(0, st.random_rows, self._draw(x[st.random_rows], st))
        lp = None
        if st.logprob_rows is not None and st.logprob_k >= 0:
            full = torch.log_softmax(logits[st.logprob_rows], dim=-1)
            top_v, top_i = full.topk(max(st.logprob_k, 1), dim=-1)
            chosen = full.gather(1, ids[st.logprob_rows][:, None])[:, 0]
            lp = (top_v, top_i, chosen)
            if st.logprob_ids is not None:  # logprob_token_ids: those ids, whatever rank
                lp = (*lp, full.gather(1, st.logprob_ids))
        return ids, lp

    def _draw(self, x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """One categorical draw per random row: [R, vocab] -> [R] int64."""
        assert st.temperature is not None
        x = x / st.temperature[:, None]
        if st.min_p is not None:
            x = min_p_filter(x, st.min_p)
        if st.top_k is not None:
            kth = x.topk(st.top_k_max, dim=-1).values  # [R, kmax], descending
            k = st.top_k.clamp(min=1, max=st.top_k_max)
            floor = kth.gather(1, (k - 1)[:, None])
            floor = torch.where(st.top_k[:, None] > 0, floor, torch.full_like(floor, -torch.inf))
            x = x.masked_fill(x < floor, -torch.inf)
        if st.top_p is not None:
            x = top_p_filter(x, st.top_p)
        probs = torch.softmax(x, dim=-1)
        # NOTE: by the inverse CDF, one uniform a row: the exponential race (probs / q,
        # q ~ Exp(1) per vocab entry) drew a random number per entry, 34.5 ms a step for
        # 16 rows of a 152k vocabulary on the CPU (torch's exponential_), against ~2 ms for
        # this. The cumulative sum is float64, so tokens far below fp32's resolution near 1
        # keep their share; a zero-probability token (filtered) is never drawn: searchsorted
        # lands past flat runs.
        u = self._uniforms(st, x.device)
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
        return ids.clamp_(max=probs.shape[-1] - 1)

    def _uniforms(self, st: SamplingTensors, device: torch.device) -> torch.Tensor:
        """[R, 1] fp64: one uniform per random row, a seeded request's from its own
        generator (so its draws do not depend on its batch-mates)."""
        assert st.random_rows is not None
        u = torch.rand(st.random_rows.shape[0], 1, generator=self._default(device),
                       device=device, dtype=torch.float64)
        for i, gen in st.seeded or ():
            u[i] = torch.rand(1, generator=gen, device=device, dtype=torch.float64)
        return u

    # -- the host convenience (tests, and callers outside the runner) --------------------
    def __call__(self, logits: torch.Tensor, request_ids: list[str],
                 params: list[SamplingParams], penalties: PenaltyState | None = None
                 ) -> SamplerOutput:
        """Sample a host batch of logits: ``sampling_tensors`` + ``sample`` + the read."""
        logits = logits.float()
        st = self.sampling_tensors(request_ids, params, logits.shape[-1], penalties,
                                   logits.device)
        ids, lp = self.sample(logits, st)
        return to_output(ids.tolist(), lp, st, params)

    def sampling_tensors(self, request_ids: list[str], params: list[SamplingParams],
                         vocab: int, penalties: PenaltyState | None,
                         device: torch.device) -> SamplingTensors:
        """``SamplingTensors`` from per-row params (host lists), for callers without a
        persistent batch; the runner builds the same from its arrays (input_batch.py)."""
        host = sampling_arrays(
            np.array([sp.temperature for sp in params], dtype=np.float32),
            np.array([sp.top_k for sp in params], dtype=np.int64),
            np.array([sp.top_p for sp in params], dtype=np.float32),
            np.array([sp.min_p for sp in params], dtype=np.float32),
            params, vocab, penalties, request_ids)
        return self.bind(host, [torch.from_numpy(a).to(device) for a in host.arrays],
                         request_ids, params, device)

    def bind(self, host: SamplingArrays, tensors: list[torch.Tensor], request_ids: list[str],
             params: list[SamplingParams], device: torch.device) -> SamplingTensors:
        """``SamplingTensors`` from the device copies of ``host.arrays`` (in order)."""
        it = iter(tensors)
        st = SamplingTensors(greedy=host.greedy, top_k_max=host.top_k_max,
                             logprob_k=host.logprob_k)
        for name in host.names:
            if name == "bias":
                st.bias = (next(it), next(it), next(it))
            elif name == "penalties":
                st.penalties = PenaltyTensors(*(next(it) for _ in range(host.num_penalty)))
            else:
                setattr(st, name, next(it))
        if not host.greedy:
            rand = host.random_rows_list
            st.seeded = [(i, g) for i, r in enumerate(rand)
                         if (g := self.generator(request_ids[r], params[r], device)) is not None]
        return st


@dataclass
class SamplingArrays:
    """The host side of ``SamplingTensors``: numpy arrays in the order ``names`` says
    (bias counts 3 arrays, penalties ``num_penalty``), ready for the step's one copy."""

    greedy: bool
    names: list[str]
    arrays: list[np.ndarray]
    random_rows_list: list[int]
    top_k_max: int = 0
    logprob_k: int = 0
    num_penalty: int = 0


def sampling_arrays(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                    min_p: np.ndarray, params: list[SamplingParams], vocab: int,
                    penalties: PenaltyState | None, request_ids: list[str]) -> SamplingArrays:
    """The host arrays a step's sampling needs, from the S rows' parameters (``temperature``
    etc.: the rows' values, in logits order; ``params``: the same rows' objects)."""
    names: list[str] = []
    arrays: list[np.ndarray] = []

    def add(name: str, *arrs: np.ndarray) -> None:
        names.append(name)
        arrays.extend(arrs)

    rand = np.flatnonzero(temperature >= 1e-5)
    out = SamplingArrays(greedy=not len(rand), names=names, arrays=arrays,
                         random_rows_list=rand.tolist())
    if len(rand):
        add("random_rows", rand.astype(np.int64))
        add("temperature", temperature[rand])
        if (min_p[rand] > 0).any():
            add("min_p", min_p[rand])
        k = top_k[rand]
        k = np.where((k > 0) & (k < vocab), k, 0)
        if k.any():
            out.top_k_max = int(k.max())
            add("top_k", k.astype(np.int64))
        if (top_p[rand] < 1).any():
            add("top_p", top_p[rand])
    bias = [(i, sp.logit_bias) for i, sp in enumerate(params) if sp.logit_bias]
    if bias:
        # NOTE: ids beyond this model's logits are dropped (P0 refuses them already).
        triples = [(i, t, b) for i, lb in bias for t, b in lb.items() if 0 <= t < vocab]
        if triples:
            r, t, b = zip(*triples)
            add("bias", np.array(r, np.int64), np.array(t, np.int64), np.array(b, np.float32))
    if penalties:
        pen = penalties.arrays(request_ids, vocab)
        if pen is not None:
            out.num_penalty = len(pen)
            add("penalties", *pen)
    want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if want:
        out.logprob_k = max(params[i].logprobs for i in want)
        add("logprob_rows", np.array(want, dtype=np.int64))
        asked = [params[i].logprob_token_ids or [] for i in want]
        if any(asked):
            # [W, M]: each row's ids, padded with its first (the pads are not read back);
            # ids beyond this model's logits are clamped (P0 refuses them already)
            width = max(len(a) for a in asked)
            table = np.zeros((len(want), width), dtype=np.int64)
            for w, a in enumerate(asked):
                if a:
                    table[w] = np.clip(a + [a[0]] * (width - len(a)), 0, vocab - 1)
            add("logprob_ids", table)
    return out


def to_output(token_ids: list[int], lp: tuple[np.ndarray | torch.Tensor, ...] | None,
              st: SamplingTensors | SamplingArrays, params: list[SamplingParams]
              ) -> SamplerOutput:
    """Token ids and host copies of the logprob tensors -> ``SamplerOutput``."""
    logprobs: list[dict[int, float] | None] = [None] * len(token_ids)
    if lp is not None:
        top_v, top_i, chosen, *extra = (np.asarray(t.cpu() if isinstance(t, torch.Tensor)
                                                   else t) for t in lp)
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        for w, i in enumerate(want):
            asked = params[i].logprob_token_ids
            k = 0 if asked else params[i].logprobs  # the ids stand in for the top k
            d = dict(zip(top_i[w, :k].tolist(), top_v[w, :k].tolist()))
            if asked and extra:
                d.update(zip(asked, extra[0][w, :len(asked)].tolist()))
            d[token_ids[i]] = float(chosen[w])
            logprobs[i] = d
    return SamplerOutput(token_ids, logprobs)


def min_p_filter(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens less likely than min_p x the row's top probability set to -inf (HF's
    MinPLogitsWarper); rows with min_p 0 keep everything. scaled: [R, V], min_p: [R]."""
    probs = torch.softmax(scaled, dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return scaled.masked_fill(probs < floor, float("-inf"))


def top_p_filter(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the tokens whose preceding mass (in descending order) is below
    top_p (the first always stays); rows with top_p 1 keep everything."""
    sorted_l, idx = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_l, dim=-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_l = sorted_l.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_l)
