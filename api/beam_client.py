"""Beam search behind both HTTP endpoints (``use_beam_search``): an engine client wrapper.

``Generation`` talks to it as to the router: ``submit`` streams RequestDeltas. Underneath,
each step of the search (engine/sample/beam_search.py) submits one one-token request per live
beam to the real client; the prefix cache shares the prompt's KV between them.

    submit -> step 1 (the prompt alone; a refusal here is the client's 400)
           -> an empty delta (the responder now watches for a gone client)
           -> steps 2..T
           -> one delta with the k beams as completions 0..k-1, best first

Streaming works the same way: the k beams arrive together in one chunk at the end. A
client that goes away cancels the search: the step requests in flight are aborted.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from triptych.api.processor import InputProcessor, ProcessedPrompt
from triptych.engine.sample.beam_search import (
    BeamSearch,
    BeamSearchParams,
    beam_max_tokens,
    beam_output,
    beam_prompt,
)
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.worker import wire


class BeamClient:
    """The engine client as ``Generation`` sees it, running beam search per job: ``n`` is
    the beam width, ``max_tokens`` / ``ignore_eos`` apply per beam."""

    def __init__(self, client: Any, processor: InputProcessor, max_model_len: int, *,
                 length_penalty: float, early_stopping: bool | str) -> None:
        self.client, self.max_model_len = client, max_model_len
        self.tokenizer = processor.tokenizer
        self.banned = (processor.image_token_id, processor.video_token_id)  # never picked
        self.length_penalty, self.early_stopping = length_penalty, early_stopping

    def new_request_id(self, prefix: str) -> str:
        return self.client.new_request_id(prefix)

    async def submit(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                     stream: bool = True) -> AsyncIterator[wire.RequestDelta]:
        """The search's answer as deltas (the texts come whole at the end, whatever
        ``stream``). Raises ValueError for a search it cannot run."""
        bp = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens,
                              ignore_eos=params.ignore_eos, length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping)
        n_prompt = len(prompt.prompt_token_ids)
        search = BeamSearch(bp, self.tokenizer.eos_token_id,
                            beam_max_tokens(bp, n_prompt, self.max_model_len), self.banned)
        cached = await self._step(request_id, 0, prompt, search)
        yield wire.RequestDelta(request_id, [], False, n_prompt, cached)
        step = 1
        while not search.done:
            await self._step(request_id, step, prompt, search)
            step += 1
        seqs = beam_output(search, prompt.prompt_token_ids, self.tokenizer,
                           params.skip_special_tokens).sequences
        want = params.logprobs is not None
        yield wire.RequestDelta(request_id, [
            wire.CompletionDelta(i, s.text, s.output_token_ids, s.finish_reason,
                                 logprobs=s.logprobs if want else None)
            for i, s in enumerate(seqs)], True, n_prompt, cached)

    async def _step(self, request_id: str, step: int, prompt: ProcessedPrompt,
                    search: BeamSearch) -> int:
        """Run one step of every live beam; returns the first beam's cached prompt tokens."""
        sp = search.step_params()
        runs = [self._one(f"{request_id}-beam{step}-{j}", beam_prompt(prompt, toks), sp)
                for j, toks in enumerate(search.pending())]
        # NOTE: a TaskGroup, not gather: one failing step request cancels its siblings.
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(r) for r in runs]
        results = [t.result() for t in tasks]
        search.advance([lps for lps, _ in results])
        return min(results[0][1], len(prompt.prompt_token_ids))

    async def _one(self, rid: str, prompt: ProcessedPrompt, sp: SamplingParams
                   ) -> tuple[dict[int, float], int]:
        lps: dict[int, float] | None = None
        cached = 0
        async with contextlib.aclosing(self.client.submit(rid, prompt, sp)) as stream:
            async for d in stream:
                cached = d.num_cached_tokens
                for c in d.completions:
                    if c.logprobs:
                        lps = c.logprobs[-1]
        if lps is None:
            raise RuntimeError(f"beam step {rid} ended without logprobs")
        return {int(t): v for t, v in lps.items()}, cached


__all__ = ["BeamClient"]
