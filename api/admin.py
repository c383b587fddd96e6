"""Operator endpoints: GET / POST /admin/pools (pool sizes, grow or shrink one).

    POST /admin/pools {"pool": "decode", "workers": 2}
      -> {"pool", "workers", "added": [names], "draining": [names]}

New workers take requests once they are up; removed ones finish (or hand over) what they
hold first (router/elastic.py). A grow the host (or Ray cluster) has no room for is a 409.

Operator endpoints: they take the admin key only (``--admin-api-key-file``; api/tenancy.py's
AuthMiddleware refuses a tenant's key with 403) and are off without one.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from triptych.api.errors import APIError, bad_request


def add_admin_routes(app: FastAPI, client: Any) -> None:
    """``client``: the Router (an engine client without ``resize_pool`` gets 501)."""

    @app.get("/admin/pools")
    async def pool_sizes() -> dict:
        if not hasattr(client, "pool_sizes"):
            raise APIError(501, "this server cannot resize its pools", "not_implemented")
        return {"pools": client.pool_sizes()}

    @app.post("/admin/pools")
    async def resize(raw: Request) -> dict:
        if not hasattr(client, "resize_pool"):
            raise APIError(501, "this server cannot resize its pools", "not_implemented")
        try:
            body = await raw.json()
        except ValueError:
            raise bad_request(None, "the body must be JSON: {\"pool\": ..., \"workers\": N}"
                              ) from None
        if not isinstance(body, dict) or not isinstance(body.get("pool"), str):
            raise bad_request("pool", "pool: a pool name (encode, prefill, decode, colocated)")
        workers = body.get("workers")
        if not isinstance(workers, int) or isinstance(workers, bool):
            raise bad_request("workers", "workers: an integer")
        from triptych.router.elastic import NoRoom

        try:
            return await client.resize_pool(body["pool"], workers)
        except NoRoom as e:
            raise APIError(409, str(e), "conflict_error", "workers") from None
        except ValueError as e:
            raise bad_request("workers" if "workers" in str(e) else "pool", str(e)) from None
