"""A preparation process (api/prep_pool.py): decodes one image or video at a time, runs the
model's image/video processor on it, and writes the pixels into a shared-memory segment of
its own, in the processor-cache ring's entry format (mmcache/shm_ring.py ``write_items``).
P0 receives only the metadata and the segment's name; the worker that runs the vision tower
reads the pixels from the segment. So no pixel passes through P0's memory, a decoder that
runs away is killed by P0 without touching anything else, and a decoder crash ends this
process, not the server.

    stdin:  frame(Start), then frame(Job) ...     (frame: 4-byte big-endian length + msgpack)
    stdout: frame(Done) once ready, then one per Job

Runs at a lower CPU priority than the server (``nice``): serving comes first on a busy
host, preparation takes what is left. One torch thread. Dies with its parent
(PR_SET_PDEATHSIG) and at end of input. Nothing is pickled.
"""
from __future__ import annotations

import os
import time
from typing import Any

from triptych.api.grammar_proc import child_pipes, read_frame, write_frame
from triptych.api.prep_wire import Done, Job, Start


def prepare(view: Any, job: Job) -> Done:
    """Decode + preprocess ``job`` with ``view`` (an InputProcessor for the job's caps) and
    write its pixels out; a refusal (MediaError, ValueError) becomes ``Done.error``."""
    from triptych.api.media.limits import MediaLimits, PixelBudget
    from triptych.api.media.video import group_key, split_groups
    from triptych.mmcache.shm_ring import write_items

    t0 = time.process_time()
    budget = PixelBudget(int(job.limits.get("max_request_pixels", 1 << 62)))
    try:
        view.media = MediaLimits.from_caps(job.limits, budget)
        item, frames = view._process_here(job.kind, job.key, job.data)
    except ValueError as e:  # MediaError included: its words are for the client
        return Done(error=str(e), cpu_s=time.process_time() - t0)
    pv = item.pixel_values.contiguous()
    if job.groups:
        entries = [(group_key(job.key, g), sub.pixel_values.contiguous())
                   for g, sub in enumerate(split_groups(item))]
    else:
        entries = [(job.key, pv)]
    name, refs = write_items(entries)
    return Done(grid=list(item.grid_thw), dtype=str(pv.dtype).removeprefix("torch."),
                shape=list(pv.shape), second_per_grid_t=item.second_per_grid_t,
                num_frames=frames, pixels_charged=budget.used, segment=name, refs=refs,
                cpu_s=time.process_time() - t0)


def main() -> int:
    inp, out = child_pipes()
    start = read_frame(inp, Start)
    if start is None:
        return 0
    import torch

    torch.set_num_threads(1)
    from triptych.api.processor import InputProcessor

    proc = InputProcessor(start.model_dir, **start.processor_kwargs)
    if proc.mm_preprocessor == "fast":  # the resize kernel: loaded (P0 built it at start)
        from triptych.models import image_ops

        image_ops.load_resize()
    os.nice(start.nice)  # NOTE: after the imports: a first image does not wait for a
    write_frame(out, Done())  # low-priority torch import on a busy host, only its own job
    while (job := read_frame(inp, Job)) is not None:
        write_frame(out, prepare(proc.for_request(), job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
