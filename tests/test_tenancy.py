"""Tenants through the real server (issue 15, point 1; point 5's video case): API keys,
uuids and the prefix cache scoped by tenant and ``cache_salt``, and a video with lowered
``media_io_kwargs`` served again from the processor cache after its worker died."""
from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import openai
from server_fixtures import (
    data_url,
    image_part,
    img,
    make_video,
    module_server,
    png,
    text_part,
    user,
    wait_for,
)
from triptych.api.tenancy import KeyFileError, cache_scope, read_keys_file
from triptych.engine.kv.block_hash import chain_hashes

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789"}
ADMIN = "key-admin-0123456789"  # --api-key: the anonymous tenant
OPERATOR = "key-operator-0123456789"  # --admin-api-key: no tenant (/health's detail)


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    path.chmod(0o600)
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "1024",
                             "--served-model-name", "tiny", "--api-keys-file", str(path),
                             "--api-key", ADMIN, "--admin-api-key", OPERATOR)


def client(server, tenant: str) -> openai.OpenAI:
    key = ADMIN if tenant == "admin" else KEYS[tenant]
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0,
                         timeout=60)


def ask(c: openai.OpenAI, msgs: list[dict], **extra):
    return c.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                     max_tokens=4, extra_body=extra or None)


def refusal(c: openai.OpenAI, msgs: list[dict], **extra) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, msgs, **extra)
    return e.value.response.json()["error"]


def uuid_only(uuid: str, text: str = "Describe it.") -> list[dict]:
    return user({"type": "image_url", "image_url": {}, "uuid": uuid}, text_part(text))


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


# -- keys ------------------------------------------------------------------------------------
def test_no_or_bad_key_is_a_401_in_openai_shape(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = server.base + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"},
                    {"Authorization": f"Bearer {KEYS['alice']}x"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json() == {"error": {
            "message": "invalid or missing API key (send 'Authorization: Bearer <key>')",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    for path in ("/v1/models", "/v1/completions", "/invocations"):
        assert httpx.request("GET" if path == "/v1/models" else "POST",
                             server.base + path, json=body).status_code == 401, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="nope", max_retries=0
                      ).models.list()
    for path in ("/health", "/metrics", "/version", "/ping"):  # probes need no key
        assert httpx.get(server.base + path).status_code == 200, path
    for tenant in ("alice", "bob", "admin"):
        assert ask(client(server, tenant), user(text_part("hi"))).choices


# -- uuids -----------------------------------------------------------------------------------
def test_a_uuid_resolves_only_inside_its_tenant(server):
    alice, bob, admin = (client(server, t) for t in ("alice", "bob", "admin"))
    sent = user({**image_part(data_url(png(img(501)))), "uuid": "invoice-17"},
                text_part("Describe it."))
    first = ask(alice, sent).choices[0].message.content
    assert ask(alice, uuid_only("invoice-17")).choices[0].message.content == first
    # Another tenant: exactly the answer for a uuid nobody ever sent.
    held_elsewhere = refusal(bob, uuid_only("invoice-17"))
    never_sent = refusal(bob, uuid_only("invoice-99"))
    assert "uuid" in held_elsewhere["message"]
    assert held_elsewhere == {**never_sent,
                              "message": never_sent["message"].replace("invoice-99",
                                                                       "invoice-17")}
    assert refusal(admin, uuid_only("invoice-17")) == held_elsewhere
    # Bob names other pixels "invoice-17": his own, Alice's answer stays hers.
    ask(bob, user({**image_part(data_url(png(img(502)))), "uuid": "invoice-17"},
                  text_part("Describe it.")))
    assert ask(alice, uuid_only("invoice-17")).choices[0].message.content == first


def test_cache_salt_scopes_uuids_within_one_key(server):
    alice = client(server, "alice")
    sent = user({**image_part(data_url(png(img(503)))), "uuid": "salted"},
                text_part("Describe it."))
    ask(alice, sent, cache_salt="s1")
    assert ask(alice, uuid_only("salted"), cache_salt="s1").choices
    assert "uuid" in refusal(alice, uuid_only("salted"), cache_salt="s2")["message"]
    assert "uuid" in refusal(alice, uuid_only("salted"))["message"]  # no salt: other scope
    assert refusal(alice, user(text_part("hi")), cache_salt="")["param"] == "cache_salt"


# -- prefix cache ----------------------------------------------------------------------------
def test_prefix_cache_hits_stay_inside_a_tenant(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    msgs = user(text_part("Alice's private memo: the merger closes on Friday at noon. " * 3))
    # A fresh salt is a fresh scope for each tenant: nothing of it is cached yet, and the
    # same salt under another key is another scope.
    assert cached(ask(alice, msgs, cache_salt="memo")) == 0
    assert cached(ask(bob, msgs, cache_salt="memo")) == 0, "bob hit alice's blocks"
    assert cached(ask(alice, msgs, cache_salt="memo")) > 0, "alice hits her own"
    # Unsalted, each tenant still shares the chat template's blocks with itself only.
    other = user(text_part("An unrelated question about the weather tomorrow."))
    ask(bob, other)
    template = cached(ask(bob, other))  # at least the template's blocks, bob's own
    ask(alice, msgs)
    assert cached(ask(bob, msgs)) <= template, "bob hit more than his own template blocks"
    assert cached(ask(alice, msgs)) > template


def test_cache_salt_scopes_the_prefix_cache_within_one_key(server):
    alice = client(server, "alice")  # (salts not used by another test: fresh scopes)
    msgs = user(text_part("A salted prompt about the quarterly numbers, page two. " * 3))
    assert cached(ask(alice, msgs, cache_salt="q1")) == 0
    assert cached(ask(alice, msgs, cache_salt="q2")) == 0
    assert cached(ask(alice, msgs, cache_salt="q1")) > 0
    assert cached(ask(alice, msgs, cache_salt="q3")) == 0


def test_scopes_and_salted_chains():
    assert cache_scope(None, None) == ""
    assert cache_scope("a", "b|c") != cache_scope("a|b", "c")
    assert cache_scope("a", None) != cache_scope(None, "a")
    tokens = list(range(12))
    plain, salted = chain_hashes(tokens, [], 4), chain_hashes(tokens, [], 4, salt="x")
    assert len(plain) == len(salted) == 3 and not set(plain) & set(salted)
    assert chain_hashes(tokens, [], 4, salt="x") == salted


def test_keys_file_is_checked_like_a_private_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k1 alice\n")
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="too open"):
        read_keys_file(str(path))
    path.chmod(0o600)
    assert read_keys_file(str(path)) == {"k1": "alice"}
    path.write_text("k1 alice extra\n")
    with pytest.raises(KeyFileError, match=":1: expected"):
        read_keys_file(str(path))


# -- point 5: a video's key and its reload agree ---------------------------------------------
def test_lowered_video_caps_survive_a_processor_cache_hit_after_a_worker_restart(server):
    admin = client(server, "admin")
    video = data_url(make_video(4.0), "video/mp4")
    msgs = user({"type": "video_url", "video_url": {"url": video}}, text_part("What happens?"))
    low = {"media_io_kwargs": {"video": {"num_frames": 2}}}
    r = ask(admin, msgs, **low)
    tokens, answer = r.usage.prompt_tokens, r.choices[0].message.content
    # A uuid-keyed video under other caps is another item, not a hit on the 2-frame one.
    named = user({"type": "video_url", "video_url": {"url": video}, "uuid": "clip"},
                 text_part("What happens?"))
    assert ask(admin, named, **low).usage.prompt_tokens == tokens
    assert ask(admin, named).usage.prompt_tokens > tokens
    old = server.engine_pid()
    os.kill(old, signal.SIGKILL)

    def replaced() -> bool:  # (one reading of /health: the worker's death may land between two)
        h = httpx.get(server.base + "/health", headers=server.admin_headers, timeout=5).json()
        up = [w["pid"] for p in h["pools"].values() for w in p["workers"] if w["state"] == "up"]
        return h["status"] == "ok" and bool(up) and old not in up

    wait_for(replaced, "the worker to be replaced", timeout=180, step=0.3)
    # P0's processor cache still holds the key; the new worker does not hold the pixels,
    # so P0 makes them again: under the request's 2 frames, as the key says.
    again = ask(admin, msgs, **low)
    assert again.usage.prompt_tokens == tokens and again.choices[0].message.content == answer


def test_keys_come_from_the_flag_or_vllm_api_key(monkeypatch, tmp_path):
    import argparse

    from triptych.api.serve_cmd import _tenants

    def args(**kw):
        return argparse.Namespace(**{"api_key": None, "api_keys_file": None,
                                     "protect_metrics": False, **kw})
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert not _tenants(args()).enabled
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert _tenants(args()).check(b"from-env") == (True, None)
    assert _tenants(args(api_key="flag")).check(b"from-env") == (False, None)
    path = tmp_path / "keys"
    path.write_text("k1 alice\n")
    path.chmod(0o640)
    with pytest.raises(SystemExit):  # the CLI's one-line refusal, before anything starts
        _tenants(args(api_keys_file=str(path)))
