"""Sampler: logits of the last token of each finished chunk -> next token ids.

Greedy rows take argmax; random rows apply temperature, min-p, top-k, top-p and draw with
the request's own generator (seeded requests are reproducible whatever else is batched).
Before either, a request's ``logit_bias`` is added and its penalties (presence, frequency,
repetition, no-repeat n-gram: engine/penalties.py) applied, in vLLM's order. Logprobs are
those of the model's raw logits (vLLM's default), so a biased or penalised pick need not be
the top-1 there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triptych.engine.penalties import PenaltyState
from triptych.kernels.cpu import panel_gemm as cpu_panel_gemm
from triptych.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # per row: top-k (+ sampled) token -> logprob


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def __call__(self, logits: torch.Tensor, request_ids: list[str],
                 params: list[SamplingParams], penalties: PenaltyState | None = None
                 ) -> SamplerOutput:
        # logits: [N, vocab] float32
        logits = logits.float()
        n = logits.shape[0]
        biased = self._apply_bias(logits, params)
        if penalties:  # (empty: no penalised request in the batch, nothing to do)
            biased = penalties.apply(biased, request_ids)
        out = self._argmax(biased)
        rand = [i for i, sp in enumerate(params) if not sp.greedy]
        if rand:
            scaled = self._temperature_min_p(biased[rand], [params[i] for i in rand])
            for row, i in enumerate(rand):
                sp = params[i]
                out[i] = self._sample_row(scaled[row], sp, self._generator(request_ids[i], sp))
        token_ids = out.tolist()
        logprobs: list[dict[int, float] | None] = [None] * n
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            k = max(params[i].logprobs for i in want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1)
            for row, i in enumerate(want):
                kk = params[i].logprobs
                d = dict(zip(top_i[row, :kk].tolist(), top_v[row, :kk].tolist()))
                d[token_ids[i]] = float(lp[row, token_ids[i]])
                logprobs[i] = d
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def _argmax(logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over the vocab; on the CPU the C++ one (one pass, one thread per
        64 MiB of logits: docs/performance.md, "Batch 32"), same result."""
        if logits.device.type == "cpu" and logits.dim() == 2 and logits.is_contiguous() \
                and logits.numel() and cpu_panel_gemm.loaded():
            return cpu_panel_gemm.argmax(logits)
        return logits.argmax(dim=-1)

    @staticmethod
    def _apply_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        rows = [i for i, sp in enumerate(params) if sp.logit_bias]
        if not rows:
            return logits
        out = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            # NOTE: ids beyond this model's logits are dropped (P0 refuses them already).
            bias = {t: b for t, b in params[i].logit_bias.items() if 0 <= t < vocab}
            if bias:
                out[i, list(bias)] += torch.tensor(list(bias.values()), dtype=out.dtype)
        return out

    @staticmethod
    def _temperature_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[R, vocab] logits of the random rows over their temperatures, tokens below each
        row's min_p threshold (min_p x the top token's probability) set to -inf: one op
        for all rows (min_p = 0 rows keep everything)."""
        temps = torch.tensor([sp.temperature for sp in params], dtype=logits.dtype)
        scaled = logits / temps[:, None]
        min_p = torch.tensor([sp.min_p for sp in params], dtype=logits.dtype)
        if bool((min_p > 0).any()):
            probs = torch.softmax(scaled, dim=-1)
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        return scaled

    @staticmethod
    def _sample_row(row: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        # row: already over the temperature, min-p applied (_temperature_min_p)
        if sp.top_k > 0 and sp.top_k < row.numel():
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_l, idx = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_l, dim=-1)
            # Keep tokens whose preceding mass is below top_p (the first always stays).
            drop = (probs.cumsum(-1) - probs) >= sp.top_p
            sorted_l = sorted_l.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_l)
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))
