"""Stored responses (store=true): what GET /v1/responses/{id} returns and what
previous_response_id continues, per tenant and bounded.

Each tenant (the API key's; one bucket on an open server) has its own bucket: an id from
another tenant is not found, in the same words as an id that never existed. A bucket
keeps at most ``--responses-store-entries`` responses and ``--responses-store-bytes``
bytes (the response object and the conversation behind it, images included, as JSON);
the least recently stored finished ones are forgotten first. A response still running in
the background is never forgotten: a bucket full of those refuses the next one (429, the
flag named), and one response larger than the whole budget is not kept (its own id then
answers 404 naming the flag).
"""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from triptych.api.errors import APIError


@dataclass
class Entry:
    response: dict[str, Any]  # the response object as last reported
    conversation: list[dict[str, Any]] = field(default_factory=list)  # chat messages up to
    # and including this response's output, instructions left out (not inherited)
    background: bool = False
    task: asyncio.Task | None = None  # the background run, until it ends
    nbytes: int = 0

    @property
    def running(self) -> bool:
        return self.response.get("status") in ("queued", "in_progress")


def _size(entry: Entry) -> int:
    return len(json.dumps(entry.response)) + len(json.dumps(entry.conversation))


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._buckets: dict[str | None, OrderedDict[str, Entry]] = {}
        self._bytes: dict[str | None, int] = {}

    def get(self, tenant: str | None, rid: str) -> Entry | None:
        return self._buckets.get(tenant, {}).get(rid)

    def not_found(self, rid: str) -> APIError:
        return APIError(404, f"Response with id '{rid[:64]}' not found. (Each tenant's "
                             f"{self.max_entries} most recent stored responses are kept, "
                             f"{self.max_bytes} bytes at most: --responses-store-entries, "
                             "--responses-store-bytes.)", "not_found_error", "response_id")

    def put(self, tenant: str | None, rid: str, entry: Entry) -> bool:
        """Store or replace ``rid``; False when it alone is over the byte budget (then it
        is not kept). Raises 429 when every kept response is still running."""
        bucket = self._buckets.setdefault(tenant, OrderedDict())
        old = bucket.pop(rid, None)
        self._bytes[tenant] = self._bytes.get(tenant, 0) - (old.nbytes if old else 0)
        entry.nbytes = _size(entry)
        if entry.nbytes > self.max_bytes or self.max_entries == 0:
            return False
        while bucket and (len(bucket) >= self.max_entries or
                          self._bytes[tenant] + entry.nbytes > self.max_bytes):
            victim = next((k for k, e in bucket.items() if not e.running), None)
            if victim is None:
                raise APIError(429, "the response store is full of responses still running "
                                    f"({len(bucket)} of --responses-store-entries "
                                    f"{self.max_entries}, --responses-store-bytes "
                                    f"{self.max_bytes}); retry when one has finished",
                               "rate_limit_error", "store", {"Retry-After": "1"})
            self._bytes[tenant] -= bucket.pop(victim).nbytes
        bucket[rid] = entry
        self._bytes[tenant] += entry.nbytes
        return True

    def delete(self, tenant: str | None, rid: str) -> bool:
        entry = self._buckets.get(tenant, {}).pop(rid, None)
        if entry is None:
            return False
        self._bytes[tenant] -= entry.nbytes
        return True

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())


__all__ = ["Entry", "ResponseStore"]
