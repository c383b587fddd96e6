"""Results handed back to callers, shaped like vLLM's so existing scripts port over."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a worker reports for one request after a step: token ids, never text.

    The API process turns these into text (detokenization, stop strings) and responses."""

    request_id: str  # the core request (a child id ``rid#i`` when the client asked n > 1)
    new_token_ids: list[int]  # tokens sampled this step (one, or none when it failed)
    new_logprobs: list[dict[int, float]] | None = None  # per new token: top ids (+ sampled)
    finish_reason: str | None = None  # stop | length | abort | error | handoff
    stop_reason: int | None = None  # the stop token id that finished it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # safe for clients: why it ended with "error"
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, with the first
    # token: per prompt position (None for the first), the prompt token's logprob + top-k


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the n completions
    text: str
    # NOTE: token_ids and logprobs are the completion's own lists, which grow until it
    # finishes (no copy per step): a consumer that reads an output later (a queue) sees
    # tokens of later steps there; token_ids_delta and logprobs_delta are this output's own.
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per output token, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop token id / string that ended it
    text_delta: str = ""  # text added since the previous output of this request (streaming)
    token_ids_delta: list[int] = field(default_factory=list)  # ids added since then
    # their logprobs, when asked for; the worker's plain {id: logprob} dicts for a request
    # registered for deltas only (router/output_processor.py: then ``logprobs`` is None)
    logprobs_delta: list[dict[int, Logprob]] | list[dict[int, float]] | None = None
    finished_now: bool = False  # this output is the first to carry its finish_reason

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine rejected the request mid-flight
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt position
