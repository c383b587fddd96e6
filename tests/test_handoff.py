"""Ready to split: a request prefilled in one engine and decoded in another gives the
same tokens as one engine doing both (KV handed over block by block)."""
from __future__ import annotations

import numpy as np
from PIL import Image

from triptych import LLM, SamplingParams


def test_prefill_in_one_engine_decode_in_another(tiny_qwen2_vl):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    conv = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "What is this?"}]}]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefill = LLM(tiny_qwen2_vl, block_size=4)
    decode = LLM(tiny_qwen2_vl, block_size=4, num_kv_blocks=64)
    (ref,) = prefill.chat(conv, sp, use_tqdm=False)

    p = prefill.processor.process_chat(conv)
    eng = prefill.engine
    eng.add_request("r", p.prompt_token_ids, sp, p.mm_items, hand_off_after_prefill=True)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    (handed,) = outs
    assert handed.finished and handed.outputs[0].finish_reason == "handoff"
    first = handed.outputs[0].token_ids[0]
    free_before = eng.kv.pool.num_free_blocks
    kv = eng.export_kv("r")  # the transfer: blocks are released once copied
    assert eng.kv.pool.num_free_blocks > free_before and not eng.kv.handed_off

    # The decode side never sees pixels: only placeholder metadata and the KV.
    decode.engine.import_request("r", p.prompt_token_ids, first, sp, kv, p.mm_items)
    done = []
    while decode.engine.has_unfinished_requests():
        done += [o for o in decode.engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert done[0].outputs[0].text == ref.outputs[0].text
    assert decode.engine.kv.pool.num_free_blocks == 64
    decode.engine.kv.check_integrity()
    eng.kv.check_integrity()
