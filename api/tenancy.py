"""API keys, tenants, and the cache scope of a request.

    Authorization: Bearer <key>  ->  tenant  ->  scope = (tenant, cache_salt)

Keys come from ``--api-key`` (or ``VLLM_API_KEY``, as vLLM) and from ``--api-keys-file``
(one ``KEY TENANT`` pair a line; ``#`` comments). A ``--api-key`` holder is the anonymous
tenant: with only that flag the server has one tenant, as vLLM does.

The scope is what a request's client-named data lives under: its uuids (mmcache/hashing.py)
and its prefix-cache blocks (engine/kv/block_hash.py, router routing). Two requests share them
only when tenant and ``cache_salt`` are both equal. Content the server hashes itself (an
image's bytes) is not scoped: see docs/tenancy.md for what that leaves observable.

The operator is not a tenant: ``--admin-api-key-file`` (or ``--admin-api-key``, SGLang's
spelling) names the one key that opens /admin/* (pool resizing) and /health's detail; no
tenant key does, and without an admin key those endpoints are off.
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
ADMIN_PREFIX = "/admin"  # operator endpoints: the admin key only


class KeyFileError(ValueError):
    """A keys file that is unreadable, too open or malformed (the message names the line)."""


def _check_private_file(path: str, flag: str) -> None:
    """Refuse, as ssh refuses a private key file, a file anyone but its owner may read or
    write, or one owned by another user (root excepted): its keys are not secret any more."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise KeyFileError(f"{flag} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{flag} {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(f"{flag} {path}: permissions {stat.S_IMODE(st.st_mode):04o}"
                           " are too open (group/others may access it); chmod 600 it")
    if st.st_uid not in (os.getuid(), 0):
        raise KeyFileError(f"{flag} {path} is owned by another user (uid {st.st_uid})")


def read_keys_file(path: str) -> dict[str, str]:
    """``KEY TENANT`` lines -> {key: tenant}; the file must be private (mode 600)."""
    _check_private_file(path, "--api-keys-file")
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


def read_admin_key_file(path: str) -> str:
    """The operator's key: the file's one non-comment line; the file must be private."""
    _check_private_file(path, "--admin-api-key-file")
    with open(path, encoding="utf-8") as f:
        lines = [x.strip() for x in f if x.strip() and not x.lstrip().startswith("#")]
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise KeyFileError(f"--admin-api-key-file {path} must hold exactly one key (one "
                           "line, no spaces)")
    return lines[0]


class Tenants:
    """Who a bearer token is: a tenant (or the anonymous one), or the operator (the admin
    key, which is no tenant: it opens /admin/* and /health's detail, never /v1). No keys
    at all: an open server."""

    def __init__(self, api_keys: Iterable[str] = (), tenant_keys: dict[str, str] | None = None,
                 admin_key: str | None = None) -> None:
        # key -> tenant; the anonymous tenant is None
        self._keys: dict[bytes, str | None] = {k.encode(): None for k in api_keys if k}
        for k, t in (tenant_keys or {}).items():
            self._keys[k.encode()] = t
        self._admin = admin_key.encode() if admin_key else None
        assert self._admin is None or self._admin not in self._keys, "admin is not a tenant"

    @property
    def enabled(self) -> bool:
        """Tenant keys are required on /v1."""
        return bool(self._keys)

    @property
    def several(self) -> bool:
        """More than one tenant holds keys: shared budgets are split between them."""
        return len(set(self._keys.values())) > 1

    @property
    def admin_enabled(self) -> bool:
        return self._admin is not None

    @property
    def open(self) -> bool:
        """No key of any kind: every caller is trusted alike (a single-user server)."""
        return not self._keys and self._admin is None

    def check(self, token: bytes) -> tuple[bool, str | None]:
        """-> (valid, tenant). Compares against every key in constant time per key, so the
        time taken does not say how much of a guess was right."""
        found, tenant = False, None
        for key, t in self._keys.items():
            if hmac.compare_digest(key, token):
                found, tenant = True, t
        return found, tenant

    def is_admin(self, token: bytes) -> bool:
        return self._admin is not None and hmac.compare_digest(self._admin, token)


def cache_scope(tenant: str | None, cache_salt: str | None) -> str:
    """The scope string of a request: "" (the shared scope) without tenant and salt, else a
    length-safe encoding of both (tenant "a" + salt "b|c" never equals "a|b" + "c")."""
    if tenant is None and cache_salt is None:
        return ""
    return json.dumps([tenant, cache_salt], separators=(",", ":"))


def tenant_of(scope: dict[str, Any]) -> str | None:
    """The tenant the auth middleware found for this ASGI request (None: anonymous)."""
    return (scope.get("state") or {}).get("tenant")


def sees_detail(scope: dict[str, Any], tenants: Tenants) -> bool:
    """Whether this caller may see the operator's view (/health's workers, pids, errors,
    nodes): the admin key's holder, or anyone on an open server."""
    return tenants.open or bool((scope.get("state") or {}).get("admin"))


def _error(status: int, message: str, code: str) -> JSONResponse:
    # OpenAI's shape; the key itself is never echoed
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": code}}, status_code=status,
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


_BAD_KEY = "invalid or missing API key (send 'Authorization: Bearer <key>')"


class AuthMiddleware:
    """Refuse requests without a valid ``Authorization: Bearer`` key with 401 (OpenAI's
    error shape) before their body is read; record the key's tenant in the ASGI state.
    /health, /ping, /version are always open, /metrics unless ``protect_metrics``.
    /admin/* takes the admin key only (a tenant's key gets 403), and is off (403) when the
    server has none."""

    def __init__(self, app: Any, tenants: Tenants, protect_metrics: bool = False) -> None:
        self.app, self.tenants, self.protect_metrics = app, tenants, protect_metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        kind, _, token = auth.partition(b" ")
        token = token.strip() if kind.lower() == b"bearer" else b""
        admin = bool(token) and self.tenants.is_admin(token)
        path = scope["path"]
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
            refusal = self._admin_refusal(token, admin)
            if refusal is not None:
                return await refusal(scope, receive, send)
        elif self.tenants.enabled and path not in OPEN_PATHS and \
                (path != METRICS_PATH or self.protect_metrics):
            ok, tenant = self.tenants.check(token) if token else (False, None)
            if not ok:
                return await _error(401, _BAD_KEY, "invalid_api_key")(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant
        if admin:
            scope.setdefault("state", {})["admin"] = True
        await self.app(scope, receive, send)

    def _admin_refusal(self, token: bytes, admin: bool) -> JSONResponse | None:
        if not self.tenants.admin_enabled:
            return _error(403, "the admin endpoints are off: start the server with "
                               "--admin-api-key-file (or --admin-api-key) to use them",
                          "admin_disabled")
        if admin:
            return None
        if token and self.tenants.check(token)[0]:
            return _error(403, "this endpoint needs the admin key; a tenant's API key "
                               "cannot use it", "admin_key_required")
        return _error(401, "invalid or missing admin key (send 'Authorization: Bearer "
                           "<admin key>')", "invalid_api_key")


__all__ = ["AuthMiddleware", "KeyFileError", "Tenants", "cache_scope", "read_admin_key_file",
           "read_keys_file", "sees_detail", "tenant_of"]
