"""Admission: the engine sequences in flight, bounded server-wide and per tenant.

A request holds one slot per engine sequence it asks for (``n`` per prompt: one request
with n=16 is 16 sequences for the engine, and holds 16 slots) from its admission until each
sequence's stream ends. Past ``--max-pending-requests`` slots a request gets 429 +
Retry-After (vLLM-style clients retry it). On a server with API keys one tenant holds at
most ``--max-pending-share`` of the slots, so a tenant that fills the queue leaves the
others theirs (as the body budget does, api/middleware.py); an open server, where everyone
is one anonymous tenant, has no shares.
"""
from __future__ import annotations

from triptych.api.errors import APIError


class Admission:
    """Slots held by admitted engine sequences: at most ``limit``, and at most
    ``share`` x ``limit`` (never less than one request's worth) per tenant when ``shared``."""

    def __init__(self, limit: int, share: float = 1.0, shared: bool = False) -> None:
        self.limit, self.active = limit, 0
        self.tenant_limit = max(1, int(share * limit)) if shared else limit
        self.by_tenant: dict[str | None, int] = {}

    def reserve(self, k: int, tenant: str | None = None) -> Slots:
        if self.active + k > self.limit:
            raise APIError(429, "the server is overloaded; retry shortly "
                                "(--max-pending-requests)", "rate_limit_error",
                           headers={"Retry-After": "1"})
        held = self.by_tenant.get(tenant, 0)
        if held and held + k > self.tenant_limit:
            # NOTE: a tenant holding nothing is always let in (up to the server's limit), so
            # a request of n sequences larger than the share is not refused forever.
            raise APIError(429, f"your requests hold {held} of this server's engine "
                                f"sequences; a tenant may hold {self.tenant_limit} at once "
                                "(--max-pending-share); retry shortly", "rate_limit_error",
                           headers={"Retry-After": "1"})
        self._add(tenant, k)
        return Slots(self, tenant, k)

    def _add(self, tenant: str | None, k: int) -> None:
        self.active += k
        left = self.by_tenant.get(tenant, 0) + k
        if left:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)


class Slots:
    """What one request holds of the admission: released as its sequences end."""

    def __init__(self, admission: Admission, tenant: str | None, k: int) -> None:
        self._a, self._tenant, self.held = admission, tenant, k

    def release(self, k: int = 1) -> None:
        k = min(k, self.held)
        self.held -= k
        self._a._add(self._tenant, -k)

    def release_all(self) -> None:
        self.release(self.held)


__all__ = ["Admission", "Slots"]
