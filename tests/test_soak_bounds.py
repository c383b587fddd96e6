"""Per-request structures of the pool workers are empty again once the requests are done.

A soak (`triptych bench soak`) shows a leak as RSS that keeps climbing; this is its lean
form: E+P+D, a dozen image requests (repeated images, greedy and seeded sampling), then
every worker's ``tracked_*`` counts (the scheduler's requests, KV blocks held per request,
seeded generators, grammar and embedding waits, encoder-cache pins, the prefill worker's
outgoing KV) must come back to 0. A structure that kept an entry per request would not.
The persistent batch keeps its last step's rows until the next step: bounded, not one
per request served.
"""
from __future__ import annotations

import os
import sys

from triptych import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat
from server_fixtures import img, wait_for

MAX_SEQS = 4
KNOBS = {"block_size": 4, "max_num_batched_tokens": 64, "max_model_len": 512,
         "max_num_seqs": MAX_SEQS}
POOLS = ("prefill", "decode")


def test_per_request_structures_return_to_empty(tiny_qwen2_vl):
    llm = LLM(tiny_qwen2_vl, **KNOBS, encode_workers=1, prefill_workers=1, decode_workers=1)
    try:
        convs = [chat(f"Picture {i}?", img(i % 4)) for i in range(12)]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=3) if i % 2 else
                  SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
                  for i in range(len(convs))]
        outs = llm.chat(convs, params, use_tqdm=False)
        assert all(o.outputs[0].token_ids for o in outs)
        done = sum(len(o.outputs[0].token_ids) for o in outs)

        def settled() -> dict[str, float] | None:
            s = llm.pools.stats()
            made = sum(s.get(f"pool/{p}/generation_tokens_total", 0) for p in POOLS)
            if made < done or "pool/prefill/tracked_kv_outgoing" not in s:
                return None  # the workers' reports of the last steps are still on the way
            left = {k: v for k, v in s.items()
                    if "/tracked_" in k and v and not k.endswith("tracked_batch_rows")}
            return s if not left else None

        s = wait_for(settled, "every per-request structure empty again", timeout=120)
        names = {k.rsplit("/", 1)[1] for k in s if "/tracked_" in k}
        assert {"tracked_requests", "tracked_kv_requests", "tracked_batch_rows",
                "tracked_seeded_generators", "tracked_embedding_waits",
                "tracked_kv_outgoing"} <= names
        # the persistent batch's rows: kept until the next step, never more than max_num_seqs
        # (the decode pool once ran every KV import at once, 12 rows: imports now wait for a
        # seat, engine/scheduler.py)
        assert all(s[f"pool/{p}/tracked_batch_rows"] <= MAX_SEQS for p in POOLS), \
            {p: s[f"pool/{p}/tracked_batch_rows"] for p in POOLS}
    finally:
        llm.close()
