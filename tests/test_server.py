"""The real server (`triptych serve` subprocess on 127.0.0.1) driven by the real openai SDK."""
from __future__ import annotations

import base64
import re
import io
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import av
import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def img(seed: int, w: int = 56, h: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def make_video(seconds: float, fps: int = 4, size: int = 56) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            arr = np.full((size, size, 3), (i * 37) % 256, dtype=np.uint8)
            arr[:, : size // 2, 1] = 200
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "ok.png").write_bytes(png(img(1)))
    return d


@pytest.fixture(scope="module")
def file_server(media_dir):
    """A local HTTP server for the media-URL tests (127.0.0.1 only)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0),
                                partial(SimpleHTTPRequestHandler, directory=str(media_dir)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, media_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "triptych", "serve", "--model", tiny_qwen2_vl, "--port",
           str(port), "--block-size", "4", "--max-model-len", "512",
           "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
           "--allowed-local-media-path", str(media_dir), "--max-image-pixels", "1000000",
           "--max-video-seconds", "3", "--max-pending-requests", "2",
           "--allowed-domains", "127.0.0.1", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.3)
    yield base
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_qwen2_vl, media_dir):
    from triptych import LLM
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=512,
               allowed_local_media_path=str(media_dir))


def offline_text(offline, messages, max_tokens: int = 6) -> str:
    from triptych import SamplingParams
    (out,) = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                          use_tqdm=False)
    return out.outputs[0].text


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(t: str) -> dict:
    return {"type": "text", "text": t}


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 6)
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.get(server + "/health", headers={"x-request-id": "abc"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.headers["x-request-id"] == "abc"


def test_image_chat_equals_offline_stream_and_not(client, offline):
    msgs = user(image_part(data_url(png(img(2)))), text_part("What is this?"))
    want = offline_text(offline, msgs)
    r = chat(client, msgs)
    assert r.choices[0].message.content == want
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 20
    chunks = list(chat(client, msgs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens_details.cached_tokens > 0


def test_two_images_video_and_multi_turn(client, offline, media_dir):
    two = user(image_part(data_url(png(img(3, 84, 56)))), text_part("and"),
               image_part(f"file://{media_dir}/ok.png"), text_part("compare"))
    assert chat(client, two).choices[0].message.content == offline_text(offline, two)
    video = user({"type": "video_url", "video_url": {"url": data_url(make_video(1.0), "video/mp4")}},
                 text_part("What happens?"))
    assert chat(client, video).choices[0].message.content == offline_text(offline, video)
    turns = user(image_part(data_url(png(img(4)))), text_part("Describe."))
    turns.append({"role": "assistant", "content": "A picture."})
    turns.append({"role": "user", "content": "What colour?"})
    turns.append({"role": "assistant", "content": "Many."})
    turns.append({"role": "user", "content": [text_part("And the shape?")]})
    assert chat(client, turns).choices[0].message.content == offline_text(offline, turns)


def test_completions_endpoint(client, offline):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                  temperature=0)
    from triptych import SamplingParams
    (want,) = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5),
                               use_tqdm=False)
    assert r.choices[0].text == want.outputs[0].text


BIG = Image.new("RGB", (1200, 1000))


@pytest.mark.parametrize("name,messages,status", [
    ("too many images", user(*[image_part(data_url(png(img(i)))) for i in range(3)]), 400),
    ("too many pixels", user(image_part(data_url(png(BIG)))), 400),
    ("corrupt image", user(image_part(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40))), 400),
    ("truncated image", user(image_part(data_url(png(img(5))[:60]))), 400),
    ("bad base64", user(image_part("data:image/png;base64,!!!notbase64")), 400),
    ("ftp scheme", user(image_part("ftp://127.0.0.1/x.png")), 400),
    ("outside allowed dir", user(image_part("file:///etc/hostname")), 400),
    ("dotdot escape", None, 400),
    ("private address", None, 400),
    ("too long", [{"role": "user", "content": "word " * 600}], 400),
    ("video too long", user({"type": "video_url",
                             "video_url": {"url": data_url(make_video(5.0), "video/mp4")}}), 400),
])
def test_bad_input_gets_4xx_and_server_keeps_serving(client, media_dir, file_server, name,
                                                     messages, status):
    if name == "dotdot escape":
        messages = user(image_part(f"{media_dir}/../../etc/hostname"))
    if name == "private address":  # localhost is not on the allow-list (127.0.0.1 is)
        messages = user(image_part(f"http://localhost:{file_server}/ok.png"))
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, messages)
    assert e.value.status_code == status
    body = e.value.response.json()["error"]
    assert body["message"] and not re.search(r"0x[0-9a-fA-F]{6,}", body["message"])
    assert "Traceback" not in body["message"]
    assert chat(client, user(text_part("still there?"))).choices[0].message.content is not None


def test_allow_listed_url_is_fetched(client, offline, file_server, media_dir):
    msgs = user(image_part(f"http://127.0.0.1:{file_server}/ok.png"), text_part("Look."))
    local = user(image_part(f"file://{media_dir}/ok.png"), text_part("Look."))
    assert chat(client, msgs).choices[0].message.content == offline_text(offline, local)


def test_unknown_model_and_malformed_json(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=user(text_part("hi")), max_tokens=2)
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and "error" in r.json()
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def running(server) -> float:
    text = httpx.get(server + "/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == "triptych:num_requests_running":
            return fam.samples[0].value
    raise AssertionError("gauge missing")


def test_disconnect_frees_the_request(server):
    body = {"model": "tiny", "messages": user(text_part("Tell a long story.")), "stream": True,
            "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    # Gone mid-stream: the engine must stop and free it.
    deadline = time.time() + 3
    while time.time() < deadline and running(server) != 0:
        time.sleep(0.1)
    assert running(server) == 0


def test_overload_gets_503_with_retry_after(server):
    # --max-pending-requests 2: of 8 simultaneous long requests some must be turned away.
    body = {"model": "tiny", "messages": user(text_part("Go on.")), "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(httpx.post(server + "/v1/chat/completions", json=body, timeout=60))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 503 in codes, codes
    assert set(codes) == {200, 503}
    assert all(r.headers["retry-after"] == "1" for r in results if r.status_code == 503)


def test_metrics_parse_and_move(client, server):
    def values() -> dict[str, float]:
        out = {}
        for fam in text_string_to_metric_families(httpx.get(server + "/metrics").text):
            for s in fam.samples:
                out.setdefault(s.name, s.value)
        return out

    before = values()
    chat(client, user(text_part("count me")))
    time.sleep(0.6)  # engine stats arrive every 0.25 s
    after = values()
    for name in ("triptych:num_requests_running", "triptych:num_requests_waiting",
                 "triptych:kv_cache_usage_perc", "triptych:num_preemptions_total",
                 "triptych:prompt_tokens_total", "triptych:generation_tokens_total",
                 "triptych:time_to_first_token_seconds_count",
                 "triptych:time_per_output_token_seconds_count",
                 "triptych:e2e_request_latency_seconds_count",
                 "triptych:prefix_cache_hits_total", "triptych:encoder_cache_queries_total"):
        assert name in after, name
    assert after["triptych:generation_tokens_total"] >= before.get(
        "triptych:generation_tokens_total", 0) + 6
    assert after["triptych:e2e_request_latency_seconds_count"] == \
        before["triptych:e2e_request_latency_seconds_count"] + 1
