"""What one step of the model runner carries between its calls (engine/runner/model_runner.py):

    prepare(out) -> PendingStep    sample(p) -> InFlight    collect(f) -> StepOutput

and the step's device inputs (``DeviceStep``) and per-phase clock (``StepTimes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from triptych.engine.device.device_io import Fetching
from triptych.engine.request import Request
from triptych.engine.runner.forward_context import AttentionMetadata
from triptych.engine.runner.input_batch import StepInputs
from triptych.engine.sample.sampler import SamplingArrays
from triptych.engine.scheduler import SchedulerOutput


class StepTimes:
    """Seconds spent per phase of ``execute`` (summed over steps; read by the profiler)."""

    PHASES = ("inputs", "vision", "forward", "logits", "sampling")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def add(self, marks: list[float]) -> None:
        for name, a, b in zip(self.PHASES, marks, marks[1:]):
            self.totals[name] += b - a
        self.steps += 1


@dataclass
class DeviceStep:
    """A step's inputs on the device (views of one staged copy) and the metadata that
    attention reads; ``extra``: the device copies of the extra host arrays staged with it."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [3, T] int64
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # [S + P] int64, None: every row, in order
    extra: list[torch.Tensor]
    graph_bucket: int | None = None  # the captured decode graph this step replays
    graph_partition: torch.Tensor | None = None  # [1] int32: its decode tokens per split


class GreedyIds:
    """run_model's answer when the LM head gave the step's greedy tokens directly (no
    logits: ``greedy_tokens`` of the model, a CPU fp32 head)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


@dataclass
class PendingStep:
    """A step whose forward is launched (``prepare``) and whose sampling is not yet."""

    sched: SchedulerOutput
    reqs: list[Request]  # the sampled rows' requests, in logits order
    logits: torch.Tensor | GreedyIds | None  # [S, vocab] of the sampled rows
    marks: list[float]
    needs_previous: bool  # a sampled row's grammar or penalties need the token in flight


@dataclass
class InFlight:
    """A sampled step whose ids are on their way to the host (``sample``; ``collect``)."""

    sched: SchedulerOutput
    reqs: list[Request]  # in logits order
    ids: torch.Tensor | None  # [S] int64 on the device: the next step reads inputs here
    copy: Fetching | None  # the step's one device -> host copy (ids, then logprobs)
    host: SamplingArrays | None
    has_logprobs: bool
    dead: dict[str, str] = field(default_factory=dict)  # grammar rows to end, and why
    index: dict[str, int] = field(default_factory=dict)  # request id -> its place in ids

    def __post_init__(self) -> None:
        self.index = {r.request_id: i for i, r in enumerate(self.reqs)}


@dataclass
class StepOutput:
    """What a step produced, by request id."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)
    dead: dict[str, str] = field(default_factory=dict)  # their grammar ended them: the
    # token sampled without it is not theirs (the engine core ends them)


NO_ARRAYS = SamplingArrays(greedy=True, names=[], arrays=[], random_rows_list=[])


def in_flight_rows(batch: Any, last: InFlight | None) -> np.ndarray:
    """Per row of ``batch``: 1 where its last token is the uncollected step's (still on
    the device), else 0."""
    flags = np.zeros(batch.num_reqs, dtype=np.int64)
    if last is not None:
        for row in range(batch.num_reqs):
            i = last.index.get(batch.reqs[row].request_id)
            flags[row] = i is not None and last.reqs[i] is batch.reqs[row]
    return flags


def device_inputs(batch: Any, last: InFlight | None, inp: StepInputs,
                  num_scheduled: np.ndarray, in_flight: np.ndarray) -> list[np.ndarray]:
    """(flat index, index in ``last``'s ids) of every input that is a token still on the
    device: the forward reads it there, the host never waits for it. Empty: none."""
    rows = np.flatnonzero(in_flight)
    if not len(rows):
        return []
    assert last is not None
    start = inp.cu_seqlens_q[rows].astype(np.int64)
    # the token in flight sits at position num_tokens (the known ones come before it)
    off = batch.num_tokens[rows] - batch.num_computed[rows]
    assert ((off >= 0) & (off < num_scheduled[rows])).all(), "in-flight token not scheduled"
    src = [last.index[batch.reqs[r].request_id] for r in rows.tolist()]
    return [start + off, np.asarray(src, dtype=np.int64)]
