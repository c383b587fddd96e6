"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the logprob of each prompt token
under the logits of the position before it, and the top k there.

The positions a step computes come after its sampled rows in the logits
(``StepInputs.logits_index``, ``StepInputs.prompt_rows``); the scheduler gives a request
asking for them at most ``PROMPT_LOGPROBS_CHUNK`` prompt tokens a step, so these logits
stay as large as the profile run measured. Computed on the device, read in one copy.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from triptych.engine.device.device_io import HostFetch, to_device
from triptych.engine.runner.input_batch import StepInputs


def record_prompt_logprobs(batch: Any, inp: StepInputs, logits: torch.Tensor,
                           fetch: HostFetch) -> None:
    """Write each (row, position) of ``inp.prompt_rows`` into its request's
    ``prompt_logprobs`` (keyed by the token it scores). logits: [P, vocab], in order."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = np.concatenate([
        np.asarray(batch.reqs[row].prompt_token_ids[t0 + 1:t0 + 1 + count])
        for row, t0, count in inp.prompt_rows]).astype(np.int64)
    k = max(batch.reqs[row].sampling_params.prompt_logprobs or 0
            for row, _, _ in inp.prompt_rows)
    tgt = to_device(torch.from_numpy(targets), lp.device)
    tops = lp.topk(max(k, 1), dim=-1)
    chosen, top_v, top_i = fetch.fetch(
        [lp.gather(1, tgt[:, None])[:, 0], tops.values, tops.indices])
    off = 0
    for row, t0, count in inp.prompt_rows:
        req = batch.reqs[row]
        kk = req.sampling_params.prompt_logprobs or 0
        for j in range(count):
            d = dict(zip(top_i[off + j, :kk].tolist(), top_v[off + j, :kk].tolist()))
            d[int(targets[off + j])] = float(chosen[off + j])
            req.prompt_logprobs[t0 + 1 + j] = d  # keyed by the token it scores
        off += count
