"""The batch follows the schedule: before each step, the persistent batch
(``input_batch.py``) is made to hold exactly the step's requests, decodes first.

A request that is still running but not in this step (tenant shares, the token budget)
rests: its row is freed, its grammar matcher and penalty counts are kept for when it
rejoins. A finished, aborted or preempted one leaves.
"""
from __future__ import annotations

import numpy as np
from triptych.engine.request import RequestStatus
from triptych.engine.runner.input_batch import InputBatch
from triptych.engine.scheduler import SchedulerOutput


def sync_batch(batch: InputBatch, out: SchedulerOutput) -> np.ndarray:
    """Make the batch hold exactly this step's requests, decodes first; returns tokens
    per row.

    A row is rewritten when its request is new, is another object under a reused id,
    or its counters disagree with the scheduler's (preempted and resumed, imported
    with KV, tokens added from outside): the request object is the truth. (The
    scheduler has counted this step's tokens as computed already.)
    """
    scheduled = {r.request_id for r, _ in out.scheduled}
    for rid in [rid for rid in batch.index if rid not in scheduled]:
        if batch.reqs[batch.index[rid]].status == RequestStatus.RUNNING:
            batch.rest(rid)  # not its turn this step: it keeps its matcher and counts
        else:
            batch.remove(rid)  # finished, aborted or preempted
    for rid, (req, _) in list(batch.resting.items()):
        if req.status != RequestStatus.RUNNING and rid not in scheduled:
            batch.remove(rid)
    for req, n in out.scheduled:
        rid = req.request_id
        row = batch.index.get(rid)
        before = req.num_computed_tokens - n
        if row is not None and (batch.reqs[row] is not req
                                or batch.num_computed[row] != before
                                or batch.num_tokens[row] != req.num_tokens):
            batch.remove(rid)
            row = None
        if row is None:
            batch.add(req, out.block_ids[rid], num_computed=before)
        else:
            batch.set_blocks(row, out.block_ids[rid])
    batch.condense()
    num_scheduled = np.zeros(batch.num_reqs, dtype=np.int64)
    for req, n in out.scheduled:
        num_scheduled[batch.index[req.request_id]] = n
    batch.decodes_first(num_scheduled)
    return num_scheduled
