"""The one request object that flows through every pool, and its multimodal items."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from triptych.engine.sample.sampling_params import SamplingParams


@dataclass
class MMItem:
    """One image or video of a prompt, as the router built it (never as a client sent it)."""

    modality: str  # "image" | "video"
    mm_hash: str  # content hash: file bytes or pixels + size + mode + processor kwargs
    offset: int  # index of the first placeholder token in prompt_token_ids
    length: int  # number of placeholder tokens (= embedding rows)
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the spatial merge
    pixel_values: torch.Tensor | None = None  # [t*h*w, C*tps*ps*ps]; None once encoded/cached
    second_per_grid_t: float | None = None  # video only (Qwen2.5-VL temporal M-RoPE)
    embedding: torch.Tensor | None = None  # [length, hidden]: computed by an encode worker
    # and carried by the request (so no cache eviction can take it away mid-prefill)

    @property
    def end(self) -> int:
        return self.offset + self.length


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, no KV yet (or preempted)
    RUNNING = 1  # scheduled every step
    PREEMPTED = 2  # KV freed, will recompute from the start
    FINISHED_STOPPED = 3  # EOS, stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # client went away / aborted
    FINISHED_ERROR = 6  # bad input found inside the engine
    FINISHED_HANDED_OFF = 7  # left after its first token; its KV blocks go to a decode worker

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "error", 7: "handoff"}.get(int(self))


@dataclass(eq=False)  # one request is one object: ``in`` and ``remove`` on the scheduler's
class Request:       # queues compare identities (field by field: ~1 us per request passed)
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MMItem] = field(default_factory=list)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache or being written by a
    # scheduled step (the scheduler counts a step's tokens when it schedules it)
    num_output_placeholders: int = 0  # tokens scheduled steps will sample, not yet known
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    # [3, num_prompt_tokens] int64, set on admission; kept as a host array (a tensor given
    # is converted once, here), read by the batch every prefill step without a device read
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0  # decode position = token index + mrope_delta
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of full blocks
    stop_reason: int | str | None = None  # the stop token / string that finished it
    error: str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when it first ran (queue time ends)
    # prompt_logprobs: position t -> {prompt token t: logprob, top ids...} (t >= 1)
    prompt_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    hand_off_after_prefill: bool = False  # prefill worker: stop after the first token, keep KV
    num_resumed_tokens: int = 0  # output tokens it arrived with (KV import, migration): not re-emitted
    turn_steps: int = 0  # steps run in its current turn (tenant shares: took_turn)
    turn_rank: int = 0  # its place in its tenant's turn order (lowest first; the step its
    # last turn ended, or ON_TURN while one lasts)

    def __post_init__(self) -> None:
        if isinstance(self.mrope_positions, torch.Tensor):
            self.mrope_positions = self.mrope_positions.numpy()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished
