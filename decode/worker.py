"""The decode worker: continuous batching over paged KV, token ids streamed to the router.

It is also the colocated engine: a decode worker that receives whole requests (prompt,
pixels) prefills and encodes them itself, so `colocated` and E+PD layouts run this same
process. ``python -m triptych.decode.worker`` (started by the supervisor).
"""
from __future__ import annotations

from typing import Any

import msgspec
from triptych.config import EngineConfig
from triptych.engine import wire
from triptych.engine.engine_core import EngineCore
from triptych.engine.request import MMItem
from triptych.engine.worker_loop import WorkerSpec, main


def items_from_wire(items: list[wire.WireMMItem], frames: list[bytes]) -> list[MMItem]:
    """MMItems of a message; pixel frames follow frame 0 in item order (checked)."""
    out = []
    k = 1
    for it in items:
        if len(it.grid_thw) != 3:
            raise ValueError("bad patch grid")
        pv = None
        if it.pixels is not None:
            if k >= len(frames):
                raise ValueError("tensor frames do not match the items")
            pv = wire.tensor_from_frame(it.pixels, frames[k])
            k += 1
        out.append(MMItem(it.modality, it.mm_hash, it.offset, it.length, tuple(it.grid_thw),
                          pv, it.second_per_grid_t))
    if k != len(frames):
        raise ValueError("tensor frames do not match the items")
    return out


class DecodeWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.core = EngineCore(EngineConfig(**spec.config), eos_token_id=spec.eos_token_id)

    def hello(self, spec: WorkerSpec) -> wire.Hello:
        import os
        return wire.Hello(spec.worker_id, spec.pool, os.getpid(), self.core.max_model_len,
                          self.core.num_blocks)

    def handle(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        if isinstance(msg, wire.AbortRequest):
            self.core.abort(msg.request_ids)
        elif isinstance(msg, wire.AddRequest):
            try:
                items = items_from_wire(msg.mm_items, frames)
                for it in items:
                    if it.pixel_values is None and it.mm_hash not in self.core.encoder.cache:
                        raise ValueError(f"{it.modality} {it.mm_hash[:12]} has no pixels and no "
                                         "cached embedding on this worker")
                self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items,
                                      output_token_ids=msg.output_token_ids)
            except (ValueError, TypeError) as e:  # refused input: the message names it
                return [wire.RequestError(msg.request_id, str(e))]
        return []

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[msgspec.Struct]:
        outs = self.core.step()
        return [wire.StepOutputs(outs)] if outs else []

    def stats(self) -> dict[str, float]:
        return self.core.stats()


if __name__ == "__main__":
    main(DecodeWorker)
