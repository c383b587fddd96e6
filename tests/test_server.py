"""The real server (`triptych serve` subprocess on 127.0.0.1) driven by the real openai SDK:
outputs equal the offline LLM's, sampling options, metrics, cancellation, overload,
clean shutdown. Bad input: tests/test_server_bad_input.py."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    ServerProc,
    alive,
    data_url,
    file_server,
    image_part,
    img,
    make_video,
    png,
    text_part,
    user,
    video_part,
    wait_for,
)

import openai  # noqa: E402 (the [test] extra)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "ok.png").write_bytes(png(img(1)))
    return d


@pytest.fixture(scope="module")
def files(media_dir):
    httpd = file_server(media_dir)
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, media_dir, tmp_path_factory):
    s = ServerProc(tiny_qwen2_vl, tmp_path_factory.mktemp("log") / "serve.log",
                   "--block-size", "4", "--max-model-len", "512",
                   "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
                   "--allowed-local-media-path", str(media_dir), "--max-pending-requests", "64",
                   "--allowed-media-domains", "127.0.0.1", "--served-model-name", "tiny",
                   "--max-n", "64")
    yield s
    s.stop()
    s.cleanup_descendants()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def offline(tiny_qwen2_vl, media_dir):
    from triptych import LLM
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=512,
               allowed_local_media_path=str(media_dir))


def offline_text(offline, messages, max_tokens: int = MAX_TOKENS) -> str:
    from triptych import SamplingParams
    (out,) = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                          use_tqdm=False)
    return out.outputs[0].text


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def streamed_text(client, messages, **kw) -> str:
    chunks = list(chat(client, messages, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_health_and_request_ids(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.get(server.base + "/health", headers={"x-request-id": "abc"})
    h = r.json()
    assert r.status_code == 200 and h["status"] == "ok"
    (w,) = h["pools"]["colocated"]["workers"]
    assert h["pools"]["colocated"]["live"] == 1 and w["state"] == "up" and w["pid"] > 0
    assert r.headers["x-request-id"] == "abc"
    r = httpx.post(server.base + "/v1/chat/completions",
                   json={"messages": user(text_part("hi")), "max_tokens": 1})
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32  # generated
    assert r.json()["id"] != r.headers["x-request-id"]  # client ids are labels only


def test_image_chat_equals_offline_stream_and_not(client, offline):
    msgs = user(image_part(data_url(png(img(2)))), text_part("What is this?"))
    want = offline_text(offline, msgs)
    r = chat(client, msgs)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 20
    chunks = list(chat(client, msgs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before


def test_two_images_video_and_three_turns_equal_offline(client, offline, media_dir):
    two = user(image_part(data_url(png(img(3, 84, 56)))), text_part("and"),
               image_part(f"file://{media_dir}/ok.png"), text_part("compare"))
    video = user(video_part(data_url(make_video(1.0), "video/mp4")), text_part("What happens?"))
    turns = user(image_part(data_url(png(img(4)))), text_part("Describe."))
    turns += [{"role": "assistant", "content": "A picture."},
              {"role": "user", "content": "What colour?"},
              {"role": "assistant", "content": "Many."},
              {"role": "user", "content": [text_part("And the shape?")]}]
    for msgs in (two, video, turns):
        want = offline_text(offline, msgs)
        assert chat(client, msgs).choices[0].message.content == want
        assert streamed_text(client, msgs) == want


def test_completions_endpoint(client, offline):
    from triptych import SamplingParams
    (want,) = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5),
                               use_tqdm=False)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                  temperature=0)
    assert r.choices[0].text == want.outputs[0].text
    assert r.usage.completion_tokens == 5
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time",
                                            max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.outputs[0].text
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy = top-1


def test_sampling_options(client):
    msgs = user(text_part("Pick words."))
    r = chat(client, msgs, n=2, temperature=1.0, seed=7, max_completion_tokens=4)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 8
    again = chat(client, msgs, n=2, temperature=1.0, seed=7, max_completion_tokens=4)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # streaming n=2 gives both indexes
    texts = ["", ""]
    for c in chat(client, msgs, n=2, temperature=1.0, seed=7, max_tokens=4, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    # stop strings end the text before the match
    full = chat(client, msgs, max_tokens=8).choices[0].message.content
    if len(full) > 3:
        cut = chat(client, msgs, max_tokens=8, stop=[full[2:4]]).choices[0]
        assert cut.finish_reason == "stop" and full.startswith(cut.message.content)
        assert len(cut.message.content) <= 2
    # logprobs: the greedy token is the top-1 and top_logprobs has the asked length
    r = chat(client, msgs, logprobs=True, top_logprobs=3, max_tokens=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)
        assert tok.token == tok.top_logprobs[0].token
    streamed = [c for c in chat(client, msgs, logprobs=True, top_logprobs=1, max_tokens=3,
                                stream=True) if c.choices and c.choices[0].logprobs]
    assert sum(len(c.choices[0].logprobs.content) for c in streamed) == 3


def test_allow_listed_url_is_fetched_but_not_other_loopback_names(client, offline, files,
                                                                  media_dir):
    msgs = user(image_part(f"http://127.0.0.1:{files}/ok.png"), text_part("Look."))
    local = user(image_part(f"file://{media_dir}/ok.png"), text_part("Look."))
    assert chat(client, msgs).choices[0].message.content == offline_text(offline, local)
    with pytest.raises(openai.BadRequestError, match="allowed domains"):
        chat(client, user(image_part(f"http://localhost:{files}/ok.png")))


# Requests that get cut off ask for 64 completions of 460 tokens: 460 decode steps of 64
# sequences, while noticing a gone client takes one event-loop turn. The tests wait for the
# 64 to be running (an event), cut the connection, and count the aborts.
LONG = {"model": "tiny", "messages": user(text_part("Tell a long story.")), "n": 64,
        "max_tokens": 460, "temperature": 0, "ignore_eos": True}


def counters(server) -> dict[str, float]:
    return {**server.metrics(), "aborted": server.metric("triptych:request_success_total",
                                                         finished_reason="abort")}


def assert_cut_short(server, before: dict[str, float]) -> None:
    wait_for(lambda: server.metrics()["triptych:num_requests_running"] == 0, "no request running")
    after = server.metrics()
    # API-side counters move when each completion ends: no stats push to wait for.
    ended = after["triptych:request_generation_tokens_count"] - \
        before["triptych:request_generation_tokens_count"]
    made = after["triptych:request_generation_tokens_sum"] - \
        before["triptych:request_generation_tokens_sum"]
    aborted = server.metric("triptych:request_success_total", finished_reason="abort") - \
        before["aborted"]
    assert ended == 64 and aborted >= 1 and made < 64 * 460, (ended, aborted, made)
    # The engine freed the KV blocks (its gauge comes with the next stats push).
    wait_for(lambda: server.metrics()["triptych:kv_cache_usage_perc"] <= max(
        0.0, before["triptych:kv_cache_usage_perc"]), "the KV cache freed")


def test_disconnect_mid_stream_frees_the_request(server):
    before = counters(server)
    with httpx.stream("POST", server.base + "/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        wait_for(lambda: server.metrics()["triptych:num_requests_running"] == 64, "64 running")
    assert_cut_short(server, before)  # gone mid-stream


def test_disconnect_while_waiting_for_a_whole_response(server):
    before = counters(server)
    body = json.dumps(LONG).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        wait_for(lambda: server.metrics()["triptych:num_requests_running"] == 64, "64 running")
    assert_cut_short(server, before)  # gone before any byte of the answer


def test_overload_gets_429_with_retry_after(server):
    # --max-pending-requests 64 engine sequences, each request n=16: of 8 simultaneous
    # requests (128 sequences) some must be turned away.
    body = {"model": "tiny", "messages": user(text_part("Go on.")), "max_tokens": 460,
            "temperature": 0, "ignore_eos": True, "n": 16}
    results: list[httpx.Response] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        results.append(httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and "overloaded" in r.json()["error"]["message"]


def test_metrics_parse_and_move(client, server):
    before = server.metrics()
    chat(client, user(text_part("count me")))
    # Engine counters come with the workers' stats pushes (every 0.25 s): wait for them.
    after = wait_for(lambda: (m := server.metrics())["triptych:generation_tokens_total"] >=
                     before["triptych:generation_tokens_total"] + MAX_TOKENS and
                     m["triptych:prompt_tokens_total"] > before["triptych:prompt_tokens_total"]
                     and m, "the engine's token counters")
    for name in ("triptych:num_requests_running", "triptych:num_requests_waiting",
                 "triptych:kv_cache_usage_perc", "triptych:num_preemptions_total",
                 "triptych:prompt_tokens_total", "triptych:generation_tokens_total",
                 "triptych:time_to_first_token_seconds_count",
                 "triptych:time_per_output_token_seconds_count",
                 "triptych:e2e_request_latency_seconds_count",
                 "triptych:prefix_cache_hits_total", "triptych:prefix_cache_queries_total",
                 "triptych:encoder_cache_hits_total", "triptych:encoder_cache_queries_total",
                 "triptych:mm_processor_cache_hits_total",
                 "triptych:mm_processor_cache_queries_total",
                 "triptych:request_success_total"):
        assert name in after, name
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "time_per_output_token_seconds"):
        assert after[f"triptych:{h}_count"] == before[f"triptych:{h}_count"] + 1, h
    chat(client, user(image_part(data_url(png(img(9)))), text_part("x")))
    assert server.metrics()["triptych:mm_processor_cache_queries_total"] == \
        after["triptych:mm_processor_cache_queries_total"] + 1


def test_bench_serve_writes_into_its_output_dir(server, tmp_path):
    r = subprocess.run([sys.executable, "-m", "triptych", "bench", "serve", "--base-url",
                        server.base, "--num-requests", "2", "--request-rate", "inf,50",
                        "--max-tokens", "2", "--image-size", "56"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "bench-results"  # the default, under the current directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-results"]
    assert sorted(p.name for p in out.iterdir()) == ["bench_serve.json", "bench_serve.png"]
    assert f"wrote {Path('bench-results') / 'bench_serve.json'}" in r.stdout, r.stdout


def test_shutdown_is_clean(server):
    """Runs last: Ctrl-C (SIGINT, as in a terminal) stops the server without a traceback,
    and every process it started goes with it. (SIGTERM: test_supervision.py.)"""
    assert server.descendants and all(alive(p) for p in server.descendants)
    assert server.stop(signal.SIGINT) == 0
    deadline = time.time() + 30  # a hang guard
    while time.time() < deadline and any(alive(p) for p in server.descendants):
        time.sleep(0.1)
    assert not any(alive(p) for p in server.descendants)
    log = server.log_path.read_text()
    assert "Application shutdown complete" in log
    for word in ("Traceback", "KeyboardInterrupt", "CancelledError"):
        assert word not in log, log[-3000:]
    (sockets,) = re.findall(r"sockets in (\S+)", log)
    assert not os.path.exists(sockets)


def test_no_model_serves_the_built_in_demo_checkpoint(tmp_path):
    s = ServerProc(None, tmp_path / "serve.log", "--max-model-len", "256",
                   env={"TRIPTYCH_CACHE": str(tmp_path / "cache")})
    try:
        log = s.log_path.read_text()
        # Shipped in the package: nothing is built, even with an empty cache.
        assert "built-in demo checkpoint" in log and "building tiny" not in log
        (model,) = httpx.get(s.base + "/v1/models").json()["data"]
        r = httpx.post(s.base + "/v1/chat/completions", json={
            "model": model["id"], "max_tokens": 2,
            "messages": user(image_part(data_url(png(img(3)))), text_part("Hi"))},
            timeout=120)  # (the first image: the preparation process starts)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = httpx.post(s.base + "/v1/chat/completions", json={  # no "model": the one served
            "max_tokens": 2, "messages": user(text_part("Hi"))}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == model["id"]
        # The README's client snippet, as printed, with a real image for its "...".
        readme = (Path(__file__).parents[1] / "README.md").read_text()
        snippet = readme.split("3. Ask it")[1].split("```python")[1].split("```")[0]
        snippet = textwrap.dedent(snippet).replace("127.0.0.1:8000", f"127.0.0.1:{s.port}")
        b64 = data_url(png(img(4))).split(",", 1)[1]
        snippet = snippet.replace("base64,...", "base64," + b64).replace("max_tokens=128",
                                                                          "max_tokens=3")
        r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                           timeout=120, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        # The demo model may end its text before the limit: 1-3 tokens, counted in usage.
        used = re.search(r"completion_tokens=(\d+)", r.stdout)
        assert used and 1 <= int(used.group(1)) <= 3, r.stdout
    finally:
        s.stop()
        s.cleanup_descendants()
