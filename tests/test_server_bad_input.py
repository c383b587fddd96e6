"""Bad input against a real `triptych serve` with the default media guard (no allow-list):
each gets its 4xx with an OpenAI-style error body naming the problem and no internals, and
the next normal request succeeds. Also: a killed server does not leave its engine process
behind. (Worker wire garbage, engine death and restarts: tests/test_supervision.py.)"""
from __future__ import annotations

import os
import random
import re
import signal
import struct
import sys
import time
import zlib

import httpx
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    alive,
    data_url,
    file_server,
    image_part,
    img,
    make_video,
    module_server,
    png,
    text_part,
    user,
    video_part,
)

import openai  # noqa: E402 (the [test] extra)
MAX_BODY = 4 << 20


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "ok.png").write_bytes(png(img(1)))
    (d / "sub").mkdir()
    return d


@pytest.fixture(scope="module")
def files(media_dir):
    httpd = file_server(media_dir)
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, media_dir, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "512",
                             "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
                             "--allowed-local-media-path", str(media_dir / "sub"),
                             "--max-image-pixels", "1000000", "--max-video-seconds", "3",
                             "--max-request-bytes", str(MAX_BODY), "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def png_bomb(w: int = 100_000, h: int = 100_000) -> bytes:
    """A PNG header claiming w x h pixels (Pillow's decompression-bomb guard trips on open)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b""))


BIG = Image.new("RGB", (1200, 1000))
# NOTE: fixed bytes, not os.urandom: of 20,000 seeded draws of 2,000 bytes, 82 opened as a
# container with no video stream and 1 as one with no decodable frames (right answers too,
# without "decode"); this draw is one FFmpeg cannot probe at all.
CORRUPT_VIDEO = random.Random(34).randbytes(2000)
VIDEO_5S = data_url(make_video(5.0), "video/mp4")

# name -> (messages or a builder taking (media_dir, files_port), status, words in the message)
CASES = {
    "too many images": (user(*[image_part(data_url(png(img(i)))) for i in range(3)]), 400,
                        "limit_mm_per_prompt"),
    "too many videos": (user(video_part(VIDEO_5S), video_part(VIDEO_5S)), 400,
                        "limit_mm_per_prompt"),
    "too many pixels": (user(image_part(data_url(png(BIG)))), 400, "pixel"),
    "decompression bomb": (user(image_part(data_url(png_bomb()))), 400, "pixel"),
    "corrupt image": (user(image_part(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40))), 400,
                      "decode"),
    "truncated image": (user(image_part(data_url(png(img(5))[:60]))), 400, "decode"),
    "corrupt second image": ([{"role": "user", "content": "hi"}, {"role": "user", "content": [
        text_part("Look:"), image_part(data_url(png(img(4)))),
        image_part(data_url(png(img(5))[:60]))]}], 400, "decode"),
    "corrupt video": (user(video_part(data_url(CORRUPT_VIDEO, "video/mp4"))), 400, "decode"),
    "video too long": (user(video_part(VIDEO_5S)), 400, "long"),
    "bad base64": (user(image_part("data:image/png;base64,!!!notbase64")), 400, "base64"),
    "ftp scheme": (user(image_part("ftp://127.0.0.1/x.png")), 400, "unsupported"),
    "file outside allowed dir": (user(image_part("file:///etc/hostname")), 400, "outside"),
    "dotdot escape": (lambda d, _: user(image_part(f"{d}/sub/../ok.png")), 400, "outside"),
    "dotdot file url": (lambda d, _: user(image_part(f"file://{d}/sub/../../ok.png")), 400,
                        "outside"),
    "loopback ip url": (lambda _, p: user(image_part(f"http://127.0.0.1:{p}/ok.png")), 400,
                        "private"),
    "localhost url": (lambda _, p: user(image_part(f"http://localhost:{p}/ok.png")), 400,
                      "private"),
    "prompt too long": ([{"role": "user", "content": "word " * 600}], 400,
                        "maximum context length is 512"),
    "too many image tokens": (user(image_part(data_url(png(img(6, 560, 560)))),
                                   image_part(data_url(png(img(7, 560, 560))))), 400,
                              "maximum context length is 512"),
    "placeholder smuggled in text": (user(text_part("<|vision_start|><|image_pad|>"
                                                    "<|vision_end|>")), 400, ""),
}


# One image or video refused: the refusal names its field (README: "names the field").
IMAGE, VIDEO = "messages.0.content.0.image_url", "messages.0.content.0.video_url"
FIELDS = {"too many pixels": IMAGE, "decompression bomb": IMAGE, "corrupt image": IMAGE,
          "truncated image": IMAGE, "corrupt video": VIDEO, "video too long": VIDEO,
          "bad base64": IMAGE, "ftp scheme": IMAGE, "file outside allowed dir": IMAGE,
          "dotdot escape": IMAGE, "dotdot file url": IMAGE, "loopback ip url": IMAGE,
          "localhost url": IMAGE, "corrupt second image": "messages.1.content.2.image_url"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_media_and_prompts(client, media_dir, files, name):
    messages, status, words = CASES[name]
    if callable(messages):
        messages = messages(media_dir, files)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert e.value.status_code == status
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert words.lower() in err["message"].lower(), err["message"]
    if name in FIELDS:
        assert err["param"] == FIELDS[name], (name, err)
    assert not re.search(r"0x[0-9a-fA-F]{6,}|Traceback|File \"", err["message"])
    ok = client.chat.completions.create(model="tiny", messages=user(text_part("still there?")),
                                        max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


BODY_CASES = {
    "malformed json": (b"{not json", 400, "json"),
    "no messages": ({"messages": []}, 400, "messages"),
    "bad role": ({"messages": [{"role": "", "content": "hi"}]}, 400, "role"),
    "unknown part type": ({"messages": user({"type": "audio_url", "audio_url": "x"})}, 400,
                          "type"),
    "image part without url": ({"messages": user({"type": "image_url"})}, 400, "image_url"),
    "text part not a string": ({"messages": user({"type": "text", "text": 5})}, 400, "text"),
    "n zero": ({"messages": user(text_part("hi")), "n": 0}, 400, "n"),
    "n huge": ({"messages": user(text_part("hi")), "n": 100_000}, 400, "n"),
    "negative temperature": ({"messages": user(text_part("hi")), "temperature": -1}, 400,
                             "temperature"),
    "top_p zero": ({"messages": user(text_part("hi")), "top_p": 0}, 400, "top_p"),
    "top_logprobs 21": ({"messages": user(text_part("hi")), "logprobs": True,
                         "top_logprobs": 21}, 400, "top_logprobs"),
    "max_tokens zero": ({"messages": user(text_part("hi")), "max_tokens": 0}, 400,
                        "max_tokens"),
    "seed beyond int64": ({"messages": user(text_part("hi")), "seed": 2**70}, 400, "seed"),
    "unknown model": ({"model": "gpt-9", "messages": user(text_part("hi"))}, 404, "gpt-9"),
    "body too large": ({"messages": user(image_part("data:image/png;base64,"
                                                    + "A" * MAX_BODY))}, 413, "larger"),
}


@pytest.mark.parametrize("name", list(BODY_CASES))
def test_bad_bodies(server, name):
    body, status, words = BODY_CASES[name]
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": {"max_tokens": 2, **body}}
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and words.lower() in err["message"].lower(), err
    ok = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                    json={"messages": user(text_part("ok")), "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_completions(server):
    url = server.base + "/v1/completions"
    for body, param, words in (({"prompt": [10**9]}, None, "token ids"),
                               ({"prompt": [[1, 2], []]}, "prompt", "at least 1"),
                               ({"prompt": []}, "prompt", ""),
                               ({"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
                               ({"prompt": ""}, None, "empty")):
        r = httpx.post(url, json=body, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and words in err["message"], r.text
        assert param is None or err["param"].startswith(param), err
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_health_then_a_killed_server_leaves_no_engine_behind(server):
    """Runs last: SIGKILL the server (no clean shutdown); the orphaned engine process
    notices and exits, removing its socket dir."""
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    sockets = re.findall(r"sockets in (\S+)", server.log_path.read_text())[0]
    assert os.path.isdir(sockets)
    server.stop(signal.SIGKILL)
    deadline = time.time() + 30  # a hang guard: each worker notices its parent is gone
    while time.time() < deadline and any(alive(p) for p in server.descendants):
        time.sleep(0.1)
    assert not any(alive(p) for p in server.descendants)
    assert not os.path.exists(sockets)
