"""Qwen3-VL (dense and MoE) after a migration: a `triptych serve` 1e1p2d on a tiny Qwen3-VL
checkpoint, a stream whose decode worker is killed (kill -9) mid-stream continues on the other decode
worker, and its full text equals an undisturbed run's (whose ids equal HF's: see
test_qwen3_vl.py). The resumed request is recomputed by a prefill with its image's
payload (embedding + DeepStack) encoded again."""
from __future__ import annotations

import os
import sys

import pytest
from triptych import LLM

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (data_url, image_part, img, make_video, module_server, png,
                             separated_prompt, text_part, user, video_part)
from test_pool_failures import kill_mid_stream, wait_ok

pytest.importorskip("openai")
MAX_LEN = 2048


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def tiny(request, tmp_path_factory) -> str:
    """Dense and MoE: the MoE's fused experts must resume a stream as the dense MLP does."""
    from triptych.models.tiny import make_tiny

    arch = request.param
    return make_tiny(arch, str(tmp_path_factory.mktemp("tiny") / arch), seed=0)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    yield from module_server(tiny, tmp_path_factory, "--block-size", "4",
                             "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "16",
                             "--encode-workers", "1", "--prefill-workers", "1",
                             "--decode-workers", "2", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def offline(tiny):
    llm = LLM(tiny, block_size=4, max_model_len=MAX_LEN)
    yield llm
    llm.close()


def test_a_stream_survives_its_decode_worker(server, offline):
    msgs, ref = separated_prompt(offline, [
        user(image_part(data_url(png(img(11 + i, 64, 96)))), text_part("Tell me a long story."))
        for i in range(12)], 300)
    got = kill_mid_stream(server, msgs, 300)
    assert got["error"] is None
    assert got["text"] == ref, "the stream resumed on the other decode worker"
    assert server.metric("triptych:request_migrations_total") >= 1
    assert wait_ok(server)


def test_health_shows_each_workers_weights(server):
    """E+P+D: /health reports what each worker loaded, as its process measured it: the
    encode worker holds no language-model weights, prefill and decode no vision weights."""
    import httpx

    assert wait_ok(server)  # every worker up, its hello (and so its weights) in
    pools = httpx.get(server.base + "/health", timeout=5).json()["pools"]
    (enc,) = pools["encode"]["workers"]
    assert enc["weights"]["parts"] == "vision"
    assert enc["weights"]["bytes"]["language"] == 0 < enc["weights"]["bytes"]["vision"]
    for w in pools["prefill"]["workers"] + pools["decode"]["workers"]:
        assert w["weights"]["parts"] == "language"
        assert w["weights"]["bytes"]["vision"] == 0 < w["weights"]["bytes"]["language"]


def test_a_served_video_equals_the_offline_run(server, offline):
    """An mp4 through E+P+D (its temporal groups encoded in the encode pool, each group's
    DeepStack payload sent to prefill) gives the offline colocated run's text, whose ids
    equal HF's (test_qwen3_vl_video.py)."""
    from triptych import SamplingParams

    msgs = user(video_part(data_url(make_video(2.0), "video/mp4")), text_part("What happens?"))
    p = offline.processor.process_chat(msgs)
    assert len(p.mm_items) >= 2 and all(it.grid_thw[0] == 1 for it in p.mm_items)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = offline.chat(msgs, sp, use_tqdm=False)[0].outputs[0].text
    r = server.openai_client(timeout=180).chat.completions.create(
        model="tiny", messages=msgs, temperature=0, max_tokens=8,
        extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want
