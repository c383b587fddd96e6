"""Admin is not a tenant (issue 36, rows 1 and 11), through a real `triptych serve` with
two tenants and an admin key file: /admin/pools takes the admin key only, a grow is
checked against the host's memory first, /health shows its detail to the operator only,
and response ids are random."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import module_server, text_part, user, wait_for
from triptych.api.tenancy import AuthMiddleware, Tenants
from triptych.router.elastic import NoRoom, check_host_room, mem_available, worker_footprint
from triptych.router.handle import WorkerHandle

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789"}
OPERATOR = "key-operator-0123456789"


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "keys").write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    (d / "admin").write_text(f"# the operator's key\n{OPERATOR}\n")
    for f in ("keys", "admin"):
        (d / f).chmod(0o600)
    for s in module_server(tiny_qwen2_vl, tmp_path_factory,
                           "--block-size", "4", "--max-model-len", "512",
                           "--served-model-name", "tiny", "--api-keys-file", str(d / "keys"),
                           "--admin-api-key-file", str(d / "admin")):
        s.admin_headers = bearer(OPERATOR)  # (the key came in a file: the helpers' /health)
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def pools(server, key: str = OPERATOR) -> httpx.Response:
    return httpx.get(server.base + "/admin/pools", headers=bearer(key), timeout=30)


def resize(server, n: int, key: str = OPERATOR) -> httpx.Response:
    return httpx.post(server.base + "/admin/pools", json={"pool": "colocated", "workers": n},
                      headers=bearer(key), timeout=30)


def test_tenant_keys_cannot_resize_or_read_the_pools(server):
    for tenant, key in KEYS.items():
        for r in (pools(server, key), resize(server, 2, key)):
            assert r.status_code == 403, (tenant, r.text)
            assert r.json()["error"]["code"] == "admin_key_required"
    for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {OPERATOR}"}):
        r = httpx.post(server.base + "/admin/pools", json={"pool": "colocated", "workers": 2},
                       headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert pools(server).json() == {"pools": {"colocated": 1}}  # nothing was resized


def test_the_admin_key_is_no_tenant_key(server):
    body = {"model": "tiny", "messages": user(text_part("hi")), "max_tokens": 1}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, headers=bearer(OPERATOR),
                   timeout=60)
    assert r.status_code == 401


def test_the_operator_grows_and_shrinks_a_pool(server):
    r = resize(server, 2)
    assert r.status_code == 200 and r.json()["added"] == ["colocated-1"], r.text
    wait_for(lambda: len(server.worker_pids()) == 2, "the new worker up", timeout=180,
             step=0.3)
    r = resize(server, 1)
    assert r.status_code == 200 and r.json()["draining"] == ["colocated-1"], r.text
    wait_for(lambda: pools(server).json()["pools"]["colocated"] == 1, "the drained worker gone")


def test_health_says_up_or_down_only_without_the_admin_key(server):
    for headers in ({}, bearer(KEYS["alice"]), bearer("wrong")):
        for path in ("/health", "/ping"):
            r = httpx.get(server.base + path, headers=headers, timeout=10)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, (path, r.text)
    detail = httpx.get(server.base + "/health", headers=bearer(OPERATOR), timeout=10).json()
    (w,) = [w for w in detail["pools"]["colocated"]["workers"] if w["state"] == "up"]
    assert w["pid"] > 0 and "start_error" in w and "node" in w


def test_response_ids_are_random(server):
    key = KEYS["bob"]
    body = {"model": "tiny", "max_tokens": 1}
    ids = []
    for path, extra, prefix in (("/v1/chat/completions", {"messages": user(text_part("hi"))},
                                 "chatcmpl"), ("/v1/completions", {"prompt": "hi"}, "cmpl")):
        for _ in range(2):
            r = httpx.post(server.base + path, json={**body, **extra}, headers=bearer(key),
                           timeout=60)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
            assert re.fullmatch(prefix + r"-[0-9a-f]{32}", ids[-1]), ids[-1]
    assert len(set(ids)) == len(ids) and not any(str(server.proc.pid) in i for i in ids)


# -- the host check of a grow ------------------------------------------------------------------
def test_a_grow_the_host_has_no_room_for_is_refused(tmp_path):
    """A live process holding 64 MiB stands for a worker: one more fits, as many as
    MemAvailable holds do not."""
    hold = "import sys; x = b'1' * (64 << 20); print(flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"\n"  # its memory is touched
        w = WorkerHandle("decode", 0, {}, proc=proc, state="up")
        each = worker_footprint(w)
        assert each >= 64 << 20
        check_host_room("decode", [w], 1)
        too_many = mem_available() // each + 1
        with pytest.raises(NoRoom, match=r"growing the decode pool by \d+ needs about"):
            check_host_room("decode", [w], too_many)
    finally:
        proc.kill()
        proc.wait(10)
    with pytest.raises(NoRoom, match="no decode worker is up yet"):
        check_host_room("decode", [WorkerHandle("decode", 1, {})], 1)


# -- off unless configured -------------------------------------------------------------------
async def _call(app, path: str, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        return await c.get(path, headers=headers)


def test_admin_endpoints_are_off_without_an_admin_key():
    import asyncio

    from fastapi import FastAPI

    inner = FastAPI()

    @inner.get("/admin/pools")
    async def _pools() -> dict:
        return {"pools": {}}

    for tenants in (Tenants(), Tenants(tenant_keys={"k": "alice"})):
        app = AuthMiddleware(inner, tenants)
        for headers in ({}, bearer("k")):
            r = asyncio.run(_call(app, "/admin/pools", headers))
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
            assert "--admin-api-key-file" in r.json()["error"]["message"]


def test_the_admin_key_flags_are_checked_at_start(monkeypatch, tmp_path):
    from triptych.api.serve_cmd import _tenants

    def args(**kw):
        return argparse.Namespace(**{"api_key": None, "api_keys_file": None,
                                     "protect_metrics": False, "admin_api_key": None,
                                     "admin_api_key_file": None, **kw})
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _tenants(args(admin_api_key="op")).is_admin(b"op")
    path = tmp_path / "admin"
    path.write_text("op\n")
    path.chmod(0o644)
    for bad in (args(admin_api_key_file=str(path)),  # readable by others
                args(api_key="same", admin_api_key="same"),  # a tenant's key
                args(admin_api_key="op", admin_api_key_file=str(path))):
        with pytest.raises(SystemExit):
            _tenants(bad)
    path.chmod(0o600)
    assert _tenants(args(admin_api_key_file=str(path))).is_admin(b"op")
