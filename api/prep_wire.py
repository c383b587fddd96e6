"""The messages between P0's preparation pool (api/prep_pool.py) and a preparation process
(api/prep_proc.py): msgspec Structs, framed msgpack on the process's stdin / stdout."""
from __future__ import annotations

from typing import Any

import msgspec
from triptych.mmcache.shm_ring import ShmItemRef


class Start(msgspec.Struct):
    model_dir: str
    processor_kwargs: dict[str, Any] = {}  # InputProcessor's keyword arguments (JSON types)
    nice: int = 10  # added to the process's CPU niceness


class Job(msgspec.Struct):
    kind: str  # "image" | "video"
    key: str  # the item's mm key (names its entries in the segment)
    data: bytes  # the encoded file
    limits: dict[str, Any]  # MediaLimits' caps (numbers) for this item
    groups: bool = False  # a video as one entry per temporal group (Qwen3-VL)


class Done(msgspec.Struct):
    error: str | None = None  # a refusal meant for the client (MediaError's words)
    grid: list[int] = []  # (t, h, w) of the whole item
    dtype: str = ""
    shape: list[int] = []  # of the whole item's pixel_values
    second_per_grid_t: float | None = None
    num_frames: int | None = None  # video: frames sampled, before padding
    pixels_charged: int = 0  # decoded pixels (the request's --max-request-pixels budget)
    segment: str = ""  # where the pixels are (one entry, or one per temporal group)
    refs: list[ShmItemRef] = []
    cpu_s: float = 0.0  # CPU time the job took here


__all__ = ["Done", "Job", "Start"]
