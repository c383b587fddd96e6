"""InternVL in E+PD and after a migration: a `triptych serve` with an encode pool feeding two
prefill+decode workers (1e2d) on the tiny InternVL checkpoint. A stream whose PD worker is
killed (kill -9) mid-stream continues on the other one, and its full text equals an
undisturbed colocated run's (whose ids equal HF's: see test_internvl.py); the resumed
request is prefilled again with its tiles' rows encoded again. The same server shows each
worker's weights in /health (encode: the tower only; PD: the language model only) and
refuses a video with a 400 that says InternVL takes images only."""
from __future__ import annotations

import os
import sys

import httpx
import pytest
from triptych import LLM

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (data_url, image_part, img, module_server, png, separated_prompt,
                             text_part, user, video_part)
from test_pool_failures import kill_mid_stream, wait_ok

pytest.importorskip("openai")
MAX_LEN = 2048


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("internvl", str(tmp_path_factory.mktemp("tiny") / "internvl"), seed=0)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    yield from module_server(tiny, tmp_path_factory, "--block-size", "4",
                             "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "16",
                             "--encode-workers", "1", "--decode-workers", "2",
                             "--served-model-name", "tiny")


def test_a_stream_survives_its_pd_worker(server, tiny):
    offline = LLM(tiny, block_size=4, max_model_len=MAX_LEN)
    msgs, ref = separated_prompt(offline, [
        user(image_part(data_url(png(img(11 + i, 120, 56)))), text_part("Tell me a long story."))
        for i in range(12)], 200)
    offline.close()
    got = kill_mid_stream(server, msgs, 200)
    assert got["error"] is None
    assert got["text"] == ref, "the stream resumed on the other PD worker"
    assert server.metric("triptych:request_migrations_total") >= 1
    assert wait_ok(server)


def test_health_shows_each_workers_weights(server):
    assert wait_ok(server)  # every worker up, its hello (and so its weights) in
    pools = httpx.get(server.base + "/health", timeout=5).json()["pools"]
    (enc,) = pools["encode"]["workers"]
    assert enc["weights"]["parts"] == "vision"
    assert enc["weights"]["bytes"]["language"] == 0 < enc["weights"]["bytes"]["vision"]
    for w in pools["decode"]["workers"]:
        assert w["weights"]["parts"] == "language"
        assert w["weights"]["bytes"]["vision"] == 0 < w["weights"]["bytes"]["language"]


def test_a_video_is_a_400_that_says_images_only(server):
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4,
        "messages": user(video_part(data_url(b"\x00" * 64, "video/mp4")), text_part("Hi"))})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "does not take video input" in msg and "image" in msg and "\n" not in msg
    assert wait_ok(server)  # nothing else was lost
