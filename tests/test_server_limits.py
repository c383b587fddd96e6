"""Strict request schema and bounds checked before work (issue 7 points 1, 5, 6; issue 12's
validation), against a real `triptych serve`: every bad body gets a 4xx in the OpenAI error
shape naming the field and the problem (nothing internal), the server answers normally
afterwards, and no bad request costs another request anything: oversize bodies keep the
server's memory flat, NaN parameters never reach the engine while other streams run,
overflowing numbers never leak a slot, symbolic-link swaps never read outside the root.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import data_url, image_part, img, module_server, png, text_part, user

MAX_BODY = 4 << 20
MAX_PENDING = 4


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "sub" / "swap").mkdir(parents=True)
    (d / "sub" / "swap" / "a.png").write_bytes(png(img(1, 56, 56)))
    (d / "outside").mkdir()
    (d / "outside" / "a.png").write_bytes(png(img(2, 112, 112)))  # more image tokens
    return d


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, media_dir, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "512",
                             "--served-model-name", "tiny",
                             "--allowed-local-media-path", str(media_dir / "sub"), "--max-n", "4",
                             "--max-pending-requests", str(MAX_PENDING),
                             "--max-request-bytes", str(MAX_BODY))


def nan_json(**fields: object) -> bytes:
    """A chat body with non-finite numbers, as JSON parsers that allow them write it."""
    return json.dumps({"messages": user(text_part("hi")), "max_tokens": 2, **fields}).encode()


HI = user(text_part("hi"))
# name -> (body, status, param the error must name (prefix), words in its message)
CASES = {
    "image_url as a bare string": ({"messages": user({"type": "image_url",
                                                      "image_url": "http://a/b.png"})},
                                   400, "messages.0.content.0.image_url", "dictionary"),
    "video_url as a bare string": ({"messages": user({"type": "video_url",
                                                      "video_url": "http://a/b.mp4"})},
                                   400, "messages.0.content.0.video_url", "dictionary"),
    "stream_options without stream": ({"messages": HI, "stream_options": {
        "include_usage": True}}, 400, "stream_options", "stream=true"),
    "negative stop token id": ({"messages": HI, "stop_token_ids": [-1]}, 400,
                               "stop_token_ids", "greater than"),
    "stop token id beyond the vocabulary": ({"messages": HI, "stop_token_ids": [10**6]}, 400,
                                            "stop_token_ids", "vocabulary"),
    "logit_bias key not a token id": ({"messages": HI, "logit_bias": {"abc": 1}}, 400,
                                      "logit_bias", "not a token id"),
    "logit_bias key beyond the vocabulary": ({"messages": HI, "logit_bias": {"999999": 1}}, 400,
                                             "logit_bias", "vocabulary"),
    "logit_bias value above 100": ({"messages": HI, "logit_bias": {"5": 101}}, 400,
                                   "logit_bias", "less than or equal to 100"),
    "logit_bias value not a number": ({"messages": HI, "logit_bias": {"5": "x"}}, 400,
                                      "logit_bias", "number"),
    "temperature NaN": (nan_json(temperature=float("nan")), 400, "temperature", "finite"),
    "temperature Infinity": (nan_json(temperature=float("inf")), 400, "temperature",
                             "finite"),
    "top_p NaN": (nan_json(top_p=float("nan")), 400, "top_p", "finite"),
    "presence_penalty -Infinity": (nan_json(presence_penalty=float("-inf")), 400,
                                   "presence_penalty", "finite"),
    "logit_bias NaN": (nan_json(logit_bias={"5": float("nan")}), 400, "logit_bias", "finite"),
    "length_penalty NaN": (nan_json(length_penalty=float("nan")), 400, "length_penalty",
                           "finite"),
    "seed beyond int64": ({"messages": HI, "seed": 2**64}, 400, "seed", "less than"),
    "top_k beyond int32": ({"messages": HI, "top_k": 2**70}, 400, "top_k", "less than"),
    "max_tokens 10**30": ({"messages": HI, "max_tokens": 10**30}, 400, "max_tokens",
                          "less than"),
    "max_tokens beyond the context": ({"messages": HI, "max_tokens": 600}, 400, "max_tokens",
                                      "maximum context length is 512 tokens"),
    "max_completion_tokens beyond the context": ({"messages": HI, "max_completion_tokens": 511},
                                                 400, "max_completion_tokens", "511"),
    "n above the server's cap": ({"messages": HI, "n": 5}, 400, "n", "--max-n"),
    "best_of above the server's cap": ({"messages": HI, "best_of": 50}, 400, "best_of",
                                       "--max-n"),
    "best_of other than n": ({"messages": HI, "best_of": 2}, 400, "best_of", "not supported"),
    "prompt_logprobs out of range": ({"messages": HI, "prompt_logprobs": 21}, 400,
                                     "prompt_logprobs", "20"),
    "presence_penalty out of range": ({"messages": HI, "presence_penalty": 2.5}, 400,
                                      "presence_penalty", "less than or equal to 2"),
    "unknown vllm_xargs key": ({"messages": HI, "vllm_xargs": {"foo": 1}}, 400, "vllm_xargs",
                               "not supported"),
    "json_schema without a schema": ({"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format",
        "json_schema.schema"),
    "tools without --enable-auto-tool-choice": (
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400, "tool_choice", "--enable-auto-tool-choice"),
    "chat template in the request": ({"messages": HI, "chat_template": "{{ 7 * 7 }}"}, 400,
                                     "chat_template", "not allowed"),
    "reserved chat_template_kwargs": ({"messages": HI, "chat_template_kwargs": {
        "tokenize": True}}, 400, "chat_template_kwargs", "tokenize"),
    "top_logprobs without logprobs": ({"messages": HI, "top_logprobs": 2}, 400,
                                      "top_logprobs", "logprobs=true"),
    "continue_final_message and add_generation_prompt": (
        {"messages": HI, "continue_final_message": True, "add_generation_prompt": True}, 400,
        "continue_final_message", "cannot both"),
    "min_tokens above max_tokens": ({"messages": HI, "min_tokens": 5}, 400, "min_tokens",
                                    "larger than"),
    "truncate_prompt_tokens above max_model_len": ({"messages": HI,
                                                    "truncate_prompt_tokens": 513}, 400,
                                                   "truncate_prompt_tokens", "max_model_len"),
    "media_io_kwargs above the frame cap": ({"messages": HI, "media_io_kwargs": {
        "video": {"num_frames": 17}}}, 400, "media_io_kwargs.video.num_frames",
        "--max-video-frames"),
    "priority": ({"messages": HI, "priority": 1}, 400, "priority", "not enabled"),
    "content null for a user": ({"messages": [{"role": "user", "content": None}]}, 400,
                                "messages.0.content", "needs content"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, 400,
                         "messages.0.content", "valid"),
    "role missing": ({"messages": [{"content": "hi"}]}, 400, "messages.0.role", "required"),
    "role not a string": ({"messages": [{"role": 5, "content": "hi"}]}, 400,
                          "messages.0.role", "string"),
    "lone surrogate": (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
                       "messages.0.content", "surrogate"),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None,
                      ""),
    "not JSON": (b"{nope", 400, None, "JSON"),
    "stop string too long": ({"messages": HI, "stop": ["x" * 1001]}, 400, "stop",
                             "at most 1000"),
    "too many stop strings": ({"messages": HI, "stop": ["x"] * 17}, 400, "stop", "at most 16"),
    "too many characters": ({"messages": user(text_part("x" * 10_300))}, 400, "messages",
                            "--max-prompt-chars"),
    "too many images for the limit": ({"messages": user(*[image_part("http://a/b.png")] * 9)},
                                      400, "messages", "limit_mm_per_prompt"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_bad_body_gets_a_named_400_and_the_server_goes_on(server, name):
    body, status, param, words = CASES[name]
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": {"max_tokens": 2, **body}}
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == "invalid_request_error"
    assert words.lower() in err["message"].lower(), err
    assert param is None or (err["param"] or "").startswith(param), err
    assert not re.search(r"Traceback|File \"|0x[0-9a-f]{6,}|pydantic", err["message"])
    ok = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                    json={"messages": HI, "max_tokens": 2})
    assert ok.status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(server):
    for r in (httpx.get(server.base + "/v1/nothing"), httpx.get(server.base + "/v1/completions"),
              httpx.post(server.base + "/v1/models", json={})):
        assert r.status_code in (404, 405) and r.json()["error"]["code"] == r.status_code
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # recursion bait
    for path in ("/v1/chat/completions", "/invocations"):
        r = httpx.post(server.base + path, content=deep, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400


def _mem(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def _reply(s: socket.socket) -> bytes:
    """What the server answered, headers and body, until it stops (bounded by the timeout)."""
    out = b""
    try:
        while b"}}" not in out:
            part = s.recv(65536)
            if not part:
                break
            out += part
    except OSError:
        pass
    return out


def _raw(port: int, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\n" + head + b"\r\n")
    return s


def test_oversize_bodies_get_413_and_memory_stays_flat(server):
    pid = server.proc.pid
    before, peak_before = _mem(pid, "VmRSS"), _mem(pid, "VmHWM")
    # declared: refused from the header, before a byte of the body is read
    with _raw(server.port, b"Content-Length: 209715200\r\n") as s:
        reply = _reply(s)
    assert reply.startswith(b"HTTP/1.1 413") and b'"code":413' in reply
    # undeclared (chunked): refused once the cap is passed; the rest is never buffered
    sent, reply = 0, b""
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"A" * (1 << 20))
    with _raw(server.port, b"Transfer-Encoding: chunked\r\n") as s:
        try:
            while sent < 200 << 20:
                s.sendall(chunk)
                sent += 1 << 20
        except OSError:
            pass
        reply = _reply(s)
    assert reply.startswith(b"HTTP/1.1 413") or sent < 200 << 20, (sent, reply[:100])
    assert _mem(pid, "VmHWM") < max(peak_before, before + (64 << 20))  # the peak, too
    assert _mem(pid, "VmRSS") < before + (64 << 20)
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 200


STORY = {"messages": user(text_part("Tell a long story.")), "max_tokens": 200, "n": 2,
         "temperature": 0, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}


def test_nan_requests_never_touch_other_streams(server):
    results: list[dict] = []

    def stream() -> None:
        finish, usage, errors = {}, None, []
        with httpx.stream("POST", server.base + "/v1/chat/completions", json=STORY,
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                errors += [obj["error"]] if "error" in obj else []
                for ch in obj.get("choices", []):
                    if ch.get("finish_reason"):
                        finish[ch["index"]] = ch["finish_reason"]
                usage = obj.get("usage") or usage
        results.append({"finish": finish, "usage": usage, "errors": errors})

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    refused = []
    with httpx.Client(base_url=server.base, timeout=30) as c:
        for field in ("temperature", "top_p", "presence_penalty") * 10:
            r = c.post("/v1/chat/completions", content=nan_json(**{field: float("nan")}),
                       headers={"content-type": "application/json"})
            refused.append(r.status_code)
    for t in threads:
        t.join(120)
    assert set(refused) == {400}
    assert len(results) == 2
    for res in results:
        assert res["errors"] == [] and res["finish"] == {0: "length", 1: "length"}
        assert res["usage"]["completion_tokens"] == 400


def test_overflowing_numbers_never_leak_a_slot(server):
    bad = [{"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 2**64 - 1, "n": 2},
           {"max_tokens": 10**30}, {"top_k": 2**70}, {"min_tokens": 2**64},
           {"logit_bias": {"1": 1e300}}, {"truncate_prompt_tokens": 2**64}]
    with httpx.Client(base_url=server.base, timeout=30) as c:
        for i in range(300):
            r = c.post("/v1/chat/completions", json={"messages": HI, **bad[i % len(bad)]})
            assert r.status_code == 400, r.text
    ok: list[int] = []
    barrier = threading.Barrier(MAX_PENDING)

    def one() -> None:
        barrier.wait()
        r = httpx.post(server.base + "/v1/chat/completions", timeout=60,
                       json={"messages": HI, "max_tokens": 20, "ignore_eos": True,
                             "seed": 2**63 - 1, "temperature": 1.0})
        ok.append(r.status_code)

    threads = [threading.Thread(target=one) for _ in range(MAX_PENDING)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ok == [200] * MAX_PENDING  # every slot is still free
    assert server.wait_running(0, 60) == 0  # a hang guard: the gauge follows the stats push


def test_symlink_swaps_never_read_outside_the_root(server, media_dir):
    sub = media_dir / "sub"
    body = {"messages": user(image_part(f"{sub}/swap/a.png"), text_part("?")), "max_tokens": 1}
    # (the server's first image: its preparation process starts)
    inside = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert inside.status_code == 200
    inside_tokens = inside.json()["usage"]["prompt_tokens"]
    os.symlink(media_dir / "outside", sub / "link")
    stop = threading.Event()

    def swap() -> None:  # swap/ flips between the real directory and a link to outside/
        while not stop.is_set():
            os.rename(sub / "swap", sub / "parked")
            os.rename(sub / "link", sub / "swap")
            time.sleep(0.0005)
            os.rename(sub / "swap", sub / "link")
            os.rename(sub / "parked", sub / "swap")
            time.sleep(0.0005)

    t = threading.Thread(target=swap)
    t.start()
    codes = []
    try:
        with httpx.Client(base_url=server.base, timeout=30) as c:
            for _ in range(150):
                r = c.post("/v1/chat/completions", json=body)
                codes.append(r.status_code)
                if r.status_code == 200:
                    assert r.json()["usage"]["prompt_tokens"] == inside_tokens
                else:
                    assert r.status_code == 400
                    assert re.search("outside|not found", r.json()["error"]["message"])
    finally:
        stop.set()
        t.join(10)
        if (sub / "link").is_symlink():
            os.unlink(sub / "link")
        else:
            os.unlink(sub / "swap")
            shutil.move(str(sub / "parked"), str(sub / "swap"))
    assert 200 in codes and 400 in codes, codes  # both sides of the race were hit
    # and a plain link, not raced, is refused outright
    os.symlink(media_dir / "outside" / "a.png", sub / "direct.png")
    body["messages"] = user(image_part(f"{sub}/direct.png"), text_part("?"))
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "outside" in r.json()["error"]["message"]


def test_data_urls_still_work_after_all_that(server):
    body = {"messages": user(image_part(data_url(png(img(3)))), text_part("?")), "max_tokens": 2}
    assert httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30
                      ).status_code == 200
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
