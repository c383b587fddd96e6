"""Drop-in compatibility with vLLM's OpenAI server (issue 12), against a real `triptych serve`
driven by the openai SDK (raw httpx where the SDK hides the wire): completions logprobs /
echo / prompt lists, chat top_logprobs, streams with n > 1, logit_bias, return_token_ids,
echo / continue_final_message, truncation, usage cache accounting, media_io_kwargs,
/v1/models/{id}, /version, /invocations, vLLM's metric names, and media fetched on its own
pool. Values are checked against the offline engine (triptych.LLM) for the same request.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    ServerProc,
    data_url,
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
BASE_ARGS = ("--block-size", "4", "--max-model-len", "512", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "ok.png").write_bytes(png(img(1)))
    return d


class _Slow(BaseHTTPRequestHandler):
    """Promises 10 kB and sends a byte every 0.2 s for 60 s: a fetch that does not end by
    itself within its deadline. Counts the fetches it has seen, and notes when any of them
    ran to the end of its trickle."""

    started = 0
    lock = threading.Lock()
    trickle_ended = threading.Event()

    def do_GET(self) -> None:
        with _Slow.lock:
            _Slow.started += 1
        self.send_response(200)
        self.send_header("Content-Length", "10000")
        self.end_headers()
        try:
            for _ in range(300):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.2)
            _Slow.trickle_ended.set()
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def slow_port():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


# NOTE: a deadline, not a speed claim: the text requests of the slow-media test must finish
# while the slow fetches still wait for it, which a loaded box does with a wide margin.
FETCH_TIMEOUT = 10.0


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, media_dir, tmp_path_factory):
    s = ServerProc(tiny_qwen2_vl, tmp_path_factory.mktemp("log") / "serve.log", *BASE_ARGS,
                   "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
                   "--allowed-local-media-path", str(media_dir), "--max-n", "8",
                   "--allowed-media-domains", "127.0.0.1", "--max-video-frames", "8",
                   "--media-fetch-timeout", str(FETCH_TIMEOUT),
                   "--max-concurrent-media-fetches", "4")
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


def sp(**kw):
    from triptych import SamplingParams
    return SamplingParams(**{"temperature": 0.0, **kw})


def gen(offline, prompt, **kw):
    (out,) = offline.generate(prompt, sp(**kw), use_tqdm=False)
    return out


def post(server, path, body, **kw):
    return httpx.post(server.base + path, json=body, timeout=60, **kw)


# -- completions --------------------------------------------------------------------------
def test_completion_logprobs_are_the_models(client, offline):
    want = gen(offline, "Once upon a time", max_tokens=4, logprobs=3)
    ref = want.outputs[0]
    kw = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
          "logprobs": 3}
    # token_id:N names make the comparison exact (two ids may decode to the same text)
    r = client.completions.create(**kw, extra_body={"return_token_ids": True,
                                                    "return_tokens_as_token_ids": True})
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    assert ids == ref.token_ids and c.text == ref.text
    assert c.model_extra["prompt_token_ids"] == want.prompt_token_ids
    lp = c.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    for pos, (tid, got, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
        assert got == pytest.approx(ref.logprobs[pos][tid].logprob, abs=1e-4)
        assert top.keys() == {f"token_id:{t}" for t in ref.logprobs[pos]}
        for t, v in ref.logprobs[pos].items():
            assert top[f"token_id:{t}"] == pytest.approx(v.logprob, abs=1e-4)
    # the readable form: decoded tokens, their offsets in the text
    lp = client.completions.create(**kw).choices[0].logprobs
    assert lp.tokens == [offline.get_tokenizer().decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([ref.logprobs[i][t].logprob
                                               for i, t in enumerate(ids)], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_prompt_lists_and_token_prompts(client, offline):
    a, b = gen(offline, "The cat", max_tokens=3), gen(offline, "A dog", max_tokens=3)
    r = client.completions.create(model="tiny", prompt=["The cat", "A dog"], max_tokens=3,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.outputs[0].text] * 2 + [b.outputs[0].text] * 2
    assert r.usage.prompt_tokens == len(a.prompt_token_ids) + len(b.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    ids = [a.prompt_token_ids, b.prompt_token_ids]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in r.choices] == [a.outputs[0].text, b.outputs[0].text]
    r = client.completions.create(model="tiny", prompt=ids[1], max_tokens=3, temperature=0)
    assert [c.text for c in r.choices] == [b.outputs[0].text]
    # streamed: every chunk holds one choice; the texts add up per index
    texts = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=["The cat", "A dog"],
                                           max_tokens=3, temperature=0, stream=True):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [a.outputs[0].text, b.outputs[0].text]


def test_echo(client, offline, tiny_qwen2_vl):
    want = gen(offline, "Once upon a time", max_tokens=3)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3,
                                  temperature=0, echo=True)
    assert r.choices[0].text == "Once upon a time" + want.outputs[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=3, temperature=0, echo=True,
        stream=True))
    assert streamed == r.choices[0].text
    ids = want.prompt_token_ids
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                  echo=True)
    assert r.choices[0].text == offline.get_tokenizer().decode(ids) + want.outputs[0].text


# -- chat -----------------------------------------------------------------------------------
def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_chat_top_logprobs_gives_exactly_k(client, offline, k):
    msgs = user(text_part("Name a colour."))
    (want,) = offline.chat(msgs, sp(max_tokens=4, logprobs=k), use_tqdm=False)
    r = chat(client, msgs, logprobs=True, top_logprobs=k, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    assert r.choices[0].model_extra["token_ids"] == want.outputs[0].token_ids
    for pos, tok in enumerate(content):
        assert len(tok.top_logprobs) == k
        ref = want.outputs[0].logprobs[pos]
        assert tok.logprob == pytest.approx(ref[want.outputs[0].token_ids[pos]].logprob, abs=1e-4)
        ref_top = sorted((v.logprob for v in ref.values()), reverse=True)[:k]
        assert [t.logprob for t in tok.top_logprobs] == pytest.approx(ref_top, abs=1e-4)


def test_stream_n_gives_one_choice_per_chunk_each_finishing(client):
    msgs = user(text_part("Pick words."))
    whole = chat(client, msgs, n=3, temperature=1.0, seed=11, max_tokens=5)
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in chat(client, msgs, n=3, temperature=1.0, seed=11, max_tokens=5, stream=True):
        assert len(chunk.choices) == 1
        ch = chunk.choices[0]
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            assert finish[ch.index] is None
            finish[ch.index] = ch.finish_reason
    assert finish == ["length"] * 3
    assert texts == [c.message.content for c in whole.choices]


def test_int64_seed_with_n2(client):
    r = chat(client, user(text_part("hi")), n=2, temperature=1.0, seed=2**63 - 1, max_tokens=2)
    assert len(r.choices) == 2


def test_logit_bias_is_applied(client, offline, tiny_qwen2_vl):
    msgs = user(text_part("Say something."))
    plain = chat(client, msgs, extra_body={"return_token_ids": True})
    first = plain.choices[0].model_extra["token_ids"][0]
    forced = 300
    r = chat(client, msgs, logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [forced] * 4
    r = chat(client, msgs, logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got[0] != first
    (want,) = offline.chat(msgs, sp(max_tokens=4, logit_bias={first: -100.0}), use_tqdm=False)
    assert got == want.outputs[0].token_ids


def test_return_token_ids_chat(client, offline):
    msgs = user(image_part(data_url(png(img(5)))), text_part("What is it?"))
    (want,) = offline.chat(msgs, sp(max_tokens=4), use_tqdm=False)
    r = chat(client, msgs, extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == want.prompt_token_ids
    assert r.choices[0].model_extra["token_ids"] == want.outputs[0].token_ids
    chunks = list(chat(client, msgs, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == want.prompt_token_ids
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids")
           or []]
    assert ids == want.outputs[0].token_ids
    details = r.usage.prompt_tokens_details
    assert details.model_extra["multimodal_tokens"]["image"] == sum(
        1 for t in want.prompt_token_ids if t == offline.processor.image_token_id)


def test_echo_and_continue_final_message(client, offline):
    msgs = [{"role": "user", "content": "Write a story."},
            {"role": "assistant", "content": "Once upon"}]
    prompt = offline.processor.process_chat(msgs, add_generation_prompt=False,
                                            continue_final_message=True)
    want = gen(offline, prompt.prompt_token_ids, max_tokens=4)
    r = chat(client, msgs, extra_body={"continue_final_message": True, "echo": True,
                                       "return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == prompt.prompt_token_ids
    assert r.choices[0].message.content == "Once upon" + want.outputs[0].text
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, msgs, stream=True, extra_body={"continue_final_message": True, "echo": True}))
    assert streamed == r.choices[0].message.content
    # add_generation_prompt=false renders the conversation without the assistant header
    plain = offline.processor.process_chat(msgs[:1], add_generation_prompt=False)
    r = chat(client, msgs[:1], extra_body={"add_generation_prompt": False,
                                           "return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == plain.prompt_token_ids


def test_truncate_prompt_tokens(client, offline):
    ids = gen(offline, "one two three four five six seven eight nine ten", max_tokens=1
              ).prompt_token_ids
    assert len(ids) > 6
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):
        want = gen(offline, kept, max_tokens=3)
        r = client.completions.create(
            model="tiny", prompt=ids, max_tokens=3, temperature=0,
            extra_body={"truncate_prompt_tokens": 5, "truncation_side": side})
        assert r.usage.prompt_tokens == 5 and r.choices[0].text == want.outputs[0].text


def test_truncation_never_cuts_an_image(client, server, offline):
    msgs = user(text_part("Look at this picture carefully please."),
                image_part(data_url(png(img(6)))), text_part("What is it?"))
    ids = chat(client, msgs, extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"]
    pads = [i for i, t in enumerate(ids) if t == offline.processor.image_token_id]
    n = len(ids)
    assert len(pads) >= 2
    # keeping the last tokens from inside the image's span: refused, by name
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, msgs, extra_body={"truncate_prompt_tokens": n - pads[0] - 1})
    err = e.value.response.json()["error"]
    assert err["param"] == "truncate_prompt_tokens" and "image" in err["message"]
    # keeping only what follows the image drops the image whole
    keep = n - pads[-1] - 1
    r = chat(client, msgs, extra_body={"truncate_prompt_tokens": keep, "return_token_ids": True})
    assert r.usage.prompt_tokens == keep and r.model_extra["prompt_token_ids"] == ids[-keep:]
    assert r.usage.prompt_tokens_details.model_extra["multimodal_tokens"] is None
    # right truncation that keeps the image whole
    keep = pads[-1] + 1
    r = chat(client, msgs, extra_body={"truncate_prompt_tokens": keep, "truncation_side": "right",
                                       "return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == ids[:keep]
    assert r.usage.prompt_tokens_details.model_extra["multimodal_tokens"] == {"image": len(pads)}
    assert httpx.get(server.base + "/health").status_code == 200


def test_usage_cache_accounting(client):
    msgs = user(text_part("A long enough prompt to fill several KV blocks of four tokens."))
    first = chat(client, msgs, max_tokens=2).usage
    again = chat(client, msgs, max_tokens=2).usage
    d1, d2 = first.prompt_tokens_details, again.prompt_tokens_details
    assert d2.cached_tokens > 0 and d2.cached_tokens % 4 == 0
    assert d1.model_extra["created_cache_tokens"] + d1.cached_tokens == \
        first.prompt_tokens // 4 * 4
    assert d2.model_extra["created_cache_tokens"] == first.prompt_tokens // 4 * 4 - \
        d2.cached_tokens


def test_continuous_usage_stats_and_tokens_as_ids(client, server):
    chunks = list(chat(client, user(text_part("hi")), stream=True, max_tokens=3,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices and c.usage]
    assert with_choices and with_choices[-1].usage.completion_tokens == 3
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 1,
                                         "return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in r.json()["choices"][0]["logprobs"]["tokens"])


def test_media_io_kwargs_lower_the_frame_count(client):
    video = user(video_part(data_url(make_video(4.0), "video/mp4")), text_part("What?"))
    full = chat(client, video, max_tokens=1).usage.prompt_tokens
    fewer = chat(client, video, max_tokens=1,
                 extra_body={"media_io_kwargs": {"video": {"num_frames": 2}}}).usage.prompt_tokens
    assert fewer < full
    for bad in ({"video": {"num_frames": 9}}, {"video": {"fps": 5}}, {"video": {"size": 1}},
                {"audio": {}}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, video, max_tokens=1, extra_body={"media_io_kwargs": bad})
        assert "media_io_kwargs" in e.value.response.json()["error"]["param"]


# -- endpoints ------------------------------------------------------------------------------
def test_models_version_invocations(client, server, tiny_qwen2_vl):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["root"] == tiny_qwen2_vl
    assert card.model_extra["max_model_len"] == 512
    r = httpx.get(server.base + "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert httpx.get(server.base + "/version").json()["version"]
    assert httpx.get(server.base + "/ping").status_code == 200
    r = post(server, "/invocations", {"messages": user(text_part("hi")), "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = post(server, "/invocations", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = post(server, "/invocations", {"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = post(server, "/invocations", {"prompt": "hi", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def _families(server) -> dict:
    text = httpx.get(server.base + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_metric_names(client, server):
    before = server.metric("triptych:generation_tokens_total")
    chat(client, user(text_part("count me")), n=2, temperature=1.0, max_tokens=3)
    # Engine counters come with the workers' stats pushes (every 0.25 s): wait for them.
    wait_for(lambda: server.metric("triptych:generation_tokens_total") > before,
             "the engine's stats")
    fams = _families(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "gpu_cache_usage_perc", "num_preemptions", "prompt_tokens",
                 "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                 "encoder_cache_queries", "encoder_cache_hits", "mm_processor_cache_queries",
                 "mm_processor_cache_hits", "mm_cache_queries", "mm_cache_hits",
                 "request_success", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "time_per_output_token_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_prefill_kv_computed_tokens", "prompt_tokens_cached",
                 "prompt_tokens_by_source", "cache_config_info"):
        assert f"triptych:{name}" in fams, name
    success = {s.labels["finished_reason"]: s.value for s in fams["triptych:request_success"]
               .samples if s.name.endswith("_total")}
    assert success["length"] >= 2 and set(success) >= {"stop", "length", "abort", "error"}
    running = fams["triptych:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "tiny", "engine": "0", "pool": "colocated"}
    n_hist = {s.labels.get("le"): s.value for s in fams["triptych:request_params_n"].samples
              if s.name.endswith("_bucket")}
    assert n_hist["2.0"] >= 1
    info = fams["triptych:cache_config_info"].samples[0].labels
    assert info["block_size"] == "4" and info["enable_prefix_caching"] == "True"


def test_slow_media_urls_meet_their_deadline_and_do_not_delay_text(client, server, slow_port):
    slow = {"model": "tiny", "max_tokens": 1, "messages": user(
        image_part(f"http://127.0.0.1:{slow_port}/x.png"), text_part("hi"))}
    results: list[tuple[int, str]] = []

    def fetch_slow() -> None:
        r = httpx.post(server.base + "/v1/chat/completions", json=slow, timeout=120)
        results.append((r.status_code, r.json()["error"]["message"]))

    threads = [threading.Thread(target=fetch_slow) for _ in range(48)]
    for t in threads:
        t.start()
    # Every fetch slot (--max-concurrent-media-fetches 4) holds a crawling fetch ...
    wait_for(lambda: _Slow.started >= 4, "the slow fetches to start")
    for _ in range(5):  # ... and text requests go straight through meanwhile:
        chat(client, user(text_part("quick")), max_tokens=2)
        assert not results, "a slow fetch ended before a text request was answered"
    for t in threads:
        t.join(120)
    assert len(results) == 48 and all(code == 400 for code, _ in results)
    # Each ended at its deadline, not when the media server stopped sending (60 s).
    assert all("--media-fetch-timeout" in msg for _, msg in results)
    assert not _Slow.trickle_ended.is_set()


# -- units: the pieces behind the server ----------------------------------------------------
def test_sampler_logit_bias():
    import torch
    from triptych.engine.sample.sampler import Sampler
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = Sampler()(logits, ["a"], [sp(logit_bias={2: 5.0}, logprobs=1)])
    assert out.token_ids == [2]
    # logprobs stay the model's own (raw logits), as vLLM's default
    assert set(out.logprobs[0]) == {1, 2}
    assert out.logprobs[0][2] == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))
    out = Sampler()(logits, ["a"], [sp(logit_bias={1: -100.0, 99: 3.0})])  # 99: beyond vocab
    assert out.token_ids == [3]
    for bad in ({-1: 1.0}, {1: 101.0}, {1: float("nan")}):
        with pytest.raises(ValueError):
            sp(logit_bias=bad)
    with pytest.raises(ValueError):
        sp(temperature=float("nan"))


def test_stats_convention_per_pool():
    from triptych.api.metrics import Metrics
    stats = {"pool/prefill/num_requests_running": 2.0, "pool/decode/num_requests_running": 5.0,
             "pool/decode/prefix_cache_hits": 40.0, "pool/encode/encoder_cache_queries_total": 3,
             "pool/encode/encoder_cache_usage_bytes": 1024.0,
             "pool/decode/iteration_tokens_total_bucket/8": 3.0,
             "pool/decode/iteration_tokens_total_bucket/+Inf": 4.0,
             "pool/decode/iteration_tokens_total_sum": 50.0,
             "pool/decode/iteration_tokens_total_count": 4.0,
             "num_requests_running": 99.0}  # flat keys are ignored beside pool keys
    m = Metrics(lambda: stats, "m", 64)
    from prometheus_client import generate_latest
    fams = {f.name: f for f in text_string_to_metric_families(
        generate_latest(m.registry).decode())}
    running = {s.labels["pool"]: s.value for s in fams["triptych:num_requests_running"].samples}
    assert running == {"prefill": 2.0, "decode": 5.0, "encode": 0.0}
    hits = {s.labels["pool"]: s.value for s in fams["triptych:prefix_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits["decode"] == 40.0
    assert fams["triptych:encoder_cache_usage_bytes"].samples[0].value == 1024.0
    it = {s.name: s.value for s in fams["triptych:iteration_tokens_total"].samples}
    assert it["triptych:iteration_tokens_total_count"] == 4.0
    flat = Metrics(lambda: {"num_requests_running": 1.0, "num_gpu_blocks": 64.0}, "m", 64,
                   {"block_size": "4"})
    fams = {f.name: f for f in flat.registry.collect()}
    (sample,) = fams["triptych:num_requests_running"].samples
    assert sample.labels["pool"] == "colocated" and sample.value == 1.0
    (info,) = fams["triptych:cache_config_info"].samples
    assert info.labels == {"block_size": "4", "num_gpu_blocks": "64", "engine": "0"}


def test_help_and_request_check_units():
    from triptych.api.media.decode import MediaLimits
    from triptych.api.protocol import ChatCompletionRequest
    from triptych.api.request_checks import media_limits
    base = MediaLimits(max_video_frames=8, video_fps=2.0)
    body = ChatCompletionRequest.model_validate({"messages": user(text_part("x")),
                                                 "media_io_kwargs": {"video": {"num_frames": 4,
                                                                               "fps": 1}}})
    lowered = media_limits(body, base)
    assert (lowered.max_video_frames, lowered.video_fps) == (4, 1.0)
    assert json.loads(json.dumps({"ok": True}))


# -- prompt logprobs ------------------------------------------------------------------------
def test_prompt_logprobs_are_the_models(client, server, offline):
    """prompt_logprobs (chat and completions) and echo + logprobs carry, for every prompt
    token after the first, its logprob under the model (the offline engine's values)."""
    from triptych import SamplingParams

    text = "Once upon a time there was a picture"
    want = offline.generate([text], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=2), use_tqdm=False)[0]
    ids = want.prompt_token_ids
    ref = [None] + [d[t].logprob for t, d in zip(ids[1:], want.prompt_logprobs[1:])]
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 2, "temperature": 0,
                                         "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for t, d, v in zip(ids[1:], plp[1:], ref[1:]):
        assert d[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
        assert len(d) <= 3  # top 2 (+ the prompt token when outside them)
    # echo + logprobs: the completion's logprobs start with the echoed prompt
    r = client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 2
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref[1:], abs=1e-4)
    assert r.choices[0].text.startswith(text)
    # chat: at the top level of the response, per prompt token of the templated prompt
    c = chat(client, user(text_part("Say it.")), extra_body={"prompt_logprobs": 1})
    chat_plp = c.model_extra["prompt_logprobs"]
    assert chat_plp[0] is None and all(isinstance(d, dict) for d in chat_plp[1:])
