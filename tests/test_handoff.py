"""Ready to split: a request prefilled in one engine and decoded in another gives the
same tokens as one engine doing both (KV handed over block by block, on the path the
prefill and decode workers use: KVSender -> connector -> KVReceiver)."""
from __future__ import annotations

import os
import sys

import numpy as np
from PIL import Image

from triptych import LLM, SamplingParams
from triptych.engine.outputs import EngineCoreOutput

sys.path.insert(0, os.path.dirname(__file__))
from kv_handoff import HandOff  # noqa: E402


def test_prefill_in_one_engine_decode_in_another(tiny_qwen2_vl):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    conv = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "What is this?"}]}]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefill = LLM(tiny_qwen2_vl, block_size=4)
    decode = LLM(tiny_qwen2_vl, block_size=4, num_kv_blocks=64)
    (ref,) = prefill.chat(conv, sp, use_tqdm=False)

    p = prefill.processor.process_chat(conv)
    eng, dec = prefill.engine.core, decode.engine.core
    link = HandOff(eng, dec)
    try:
        reserved = link.reserve("r", p.prompt_token_ids, sp, p.mm_items)
        assert reserved is not None and reserved.num_cached_blocks == 0
        free_before = eng.kv.pool.num_free_blocks
        first = link.prefill_and_send("r", p.prompt_token_ids, sp, p.mm_items, reserved)
        # the transfer's end released the prefill side's blocks
        assert eng.kv.pool.num_free_blocks >= free_before and not eng.kv.handed_off
        # The decode side never saw pixels: only placeholder metadata and the KV.
        req = link.receive()
        assert req is not None and req.output_token_ids == [first]
        assert all(it.pixel_values is None for it in req.mm_items)
        # text as the API process makes it: the first token came from the prefill side
        decode.engine.outputs.add("r", None, p.prompt_token_ids, sp)
        decode.engine.outputs.process([EngineCoreOutput("r", [first])])
        done = []
        while decode.engine.has_unfinished_requests():
            done += [o for o in decode.engine.step() if o.finished]
    finally:
        link.close()
    assert req.output_token_ids == ref.outputs[0].token_ids
    assert done[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert done[0].outputs[0].text == ref.outputs[0].text
    assert dec.kv.pool.num_free_blocks == 64
    dec.kv.check_integrity()
    eng.kv.check_integrity()


def test_a_preempted_request_whose_images_live_elsewhere_is_handed_back(tiny_qwen2_vl):
    """A decode worker learns what its step preempted from the step's result; a request
    whose images it cannot encode again (pixels and embeddings stayed on the prefill side)
    goes back to the router with its tokens, instead of failing here later."""
    from triptych.decode.worker import DecodeWorker
    from triptych.worker import wire
    from triptych.worker.loop import WorkerSpec

    conv = [{"role": "user", "content": [
        {"type": "image", "image": Image.fromarray(np.full((56, 56, 3), 90, dtype=np.uint8))},
        {"type": "text", "text": "Look."}]}]
    prefill = LLM(tiny_qwen2_vl, block_size=4)
    p = prefill.processor.process_chat(conv)
    text = list(range(1, 9))  # two blocks
    need = -(-len(p.prompt_token_ids) // 4) + 2  # the image request's blocks + text's
    spec = WorkerSpec(worker_id="decode-0#0", pool="decode", router_address="ipc:///unused",
                      config={"model": tiny_qwen2_vl, "block_size": 4, "max_model_len": 256,
                              "num_kv_blocks": need + 1, "kv_transfer": "shm",
                              "enable_prefix_caching": False})
    d = DecodeWorker(spec)
    link = HandOff(prefill.engine.core, d.core)
    try:
        grow = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        d.core.add_request("text", text, grow)
        d.step()  # admitted first: the image request will be the latest admitted
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        reserved = link.reserve("img", p.prompt_token_ids, sp, p.mm_items)
        assert reserved is not None
        first = link.prefill_and_send("img", p.prompt_token_ids, sp, p.mm_items, reserved)
        assert link.receive() is not None
        back = []
        for _ in range(40):
            back += [m for m in d.step() if isinstance(m, wire.HandBack)]
            if back:
                break
        (hb,) = back
        assert hb.request_id == "img" and hb.output_token_ids[0] == first
        assert "img" not in d.core.scheduler.requests and d.num_handed_back == 1
        assert d.stats()["requests_handed_back_total"] == 1
        while d.has_work():  # the text request goes on undisturbed
            d.step()
        d.core.kv.check_integrity()
        assert d.core.kv.pool.num_free_blocks == need + 1
    finally:
        link.close()
        d.close()
