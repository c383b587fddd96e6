"""API keys, tenants, and the cache scope of a request.

    Authorization: Bearer <key>  ->  tenant  ->  scope = (tenant, cache_salt)

Keys come from ``--api-key`` (or ``VLLM_API_KEY``, as vLLM) and from ``--api-keys-file``
(one ``KEY TENANT`` pair a line; ``#`` comments). A ``--api-key`` holder is the anonymous
tenant: with only that flag the server has one tenant, as vLLM does.

The scope is what a request's client-named data lives under: its uuids (mmcache/hashing.py)
and its prefix-cache blocks (engine/block_hash.py, router routing). Two requests share them
only when tenant and ``cache_salt`` are both equal. Content the server hashes itself (an
image's bytes) is not scoped: see docs/tenancy-notes.md for what that leaves observable.
"""
from __future__ import annotations

import hmac
import json
import os
import stat
from collections.abc import Iterable
from typing import Any

from fastapi.responses import JSONResponse

OPEN_PATHS = frozenset({"/health", "/ping", "/version"})  # load balancers probe these
METRICS_PATH = "/metrics"


class KeyFileError(ValueError):
    """A keys file that is unreadable, too open or malformed (the message names the line)."""


def read_keys_file(path: str) -> dict[str, str]:
    """``KEY TENANT`` lines -> {key: tenant}. Refused, as ssh refuses a private key file,
    when anyone but its owner may read or write it, or when it is owned by another user
    (root excepted): such a file's keys are not secret any more."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise KeyFileError(f"--api-keys-file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"--api-keys-file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(f"--api-keys-file {path}: permissions {stat.S_IMODE(st.st_mode):04o}"
                           " are too open (group/others may access it); chmod 600 it")
    if st.st_uid not in (os.getuid(), 0):
        raise KeyFileError(f"--api-keys-file {path} is owned by another user (uid "
                           f"{st.st_uid})")
    keys: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise KeyFileError(f"--api-keys-file {path}:{n}: expected 'KEY TENANT'")
            key, tenant = parts
            if key in keys:
                raise KeyFileError(f"--api-keys-file {path}:{n}: a key is listed twice")
            keys[key] = tenant
    if not keys:
        raise KeyFileError(f"--api-keys-file {path} holds no keys")
    return keys


class Tenants:
    """Which tenant a bearer token belongs to. ``None`` keys: the server is open."""

    def __init__(self, api_keys: Iterable[str] = (), tenant_keys: dict[str, str] | None = None
                 ) -> None:
        # key -> tenant; the anonymous tenant is None
        self._keys: dict[bytes, str | None] = {k.encode(): None for k in api_keys if k}
        for k, t in (tenant_keys or {}).items():
            self._keys[k.encode()] = t

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, token: bytes) -> tuple[bool, str | None]:
        """-> (valid, tenant). Compares against every key in constant time per key, so the
        time taken does not say how much of a guess was right."""
        found, tenant = False, None
        for key, t in self._keys.items():
            if hmac.compare_digest(key, token):
                found, tenant = True, t
        return found, tenant


def cache_scope(tenant: str | None, cache_salt: str | None) -> str:
    """The scope string of a request: "" (the shared scope) without tenant and salt, else a
    length-safe encoding of both (tenant "a" + salt "b|c" never equals "a|b" + "c")."""
    if tenant is None and cache_salt is None:
        return ""
    return json.dumps([tenant, cache_salt], separators=(",", ":"))


def tenant_of(scope: dict[str, Any]) -> str | None:
    """The tenant the auth middleware found for this ASGI request (None: anonymous)."""
    return (scope.get("state") or {}).get("tenant")


class AuthMiddleware:
    """Refuse requests without a valid ``Authorization: Bearer`` key with 401 (OpenAI's
    error shape) before their body is read; record the key's tenant in the ASGI state.
    /health, /ping, /version are always open, /metrics unless ``protect_metrics``."""

    def __init__(self, app: Any, tenants: Tenants, protect_metrics: bool = False) -> None:
        self.app, self.tenants, self.protect_metrics = app, tenants, protect_metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tenants.enabled or \
                scope["path"] in OPEN_PATHS or \
                (scope["path"] == METRICS_PATH and not self.protect_metrics):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        kind, _, token = auth.partition(b" ")
        ok, tenant = self.tenants.check(token.strip()) if kind.lower() == b"bearer" \
            else (False, None)
        if not ok:
            # OpenAI's shape and code for a bad key; the key itself is never echoed
            resp = JSONResponse({"error": {
                "message": "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


__all__ = ["AuthMiddleware", "KeyFileError", "Tenants", "cache_scope", "read_keys_file",
           "tenant_of"]
