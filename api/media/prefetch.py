"""http(s) media of a chat request, fetched on the event loop before the processor runs.

Fetches share one bounded pool (a semaphore, ``--max-concurrent-media-fetches``) that no
text-only request ever waits on: the processor's threads only decode bytes that are
already here, so slow media servers cannot occupy them. Each fetch, the wait for a place
in the pool included, ends by ``--media-fetch-timeout``.
"""
from __future__ import annotations

import asyncio
from typing import Any

from triptych.api.media.decode import MediaError, MediaLimits, afetch_bytes, is_remote

_KINDS = {"image_url": "image", "video_url": "video"}


class MediaFetcher:
    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self._sem: asyncio.Semaphore | None = None  # made on the serving loop, on first use

    async def _fetch(self, url: str, limits: MediaLimits, max_bytes: int) -> bytes:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrent)
        async with self._sem:
            return await afetch_bytes(url, limits, max_bytes)

    async def _one(self, ref: dict[str, Any], kind: str, limits: MediaLimits) -> None:
        max_bytes = limits.max_image_bytes if kind == "image" else limits.max_video_bytes
        try:
            data = await asyncio.wait_for(self._fetch(ref["url"], limits, max_bytes),
                                          limits.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise MediaError(f"fetching media took longer than {limits.fetch_timeout_s:g} s "
                             "(--media-fetch-timeout)") from None
        ref["url"] = data  # the processor decodes bytes as it would the URL's

    async def prefetch(self, messages: list[dict[str, Any]], limits: MediaLimits) -> None:
        """Replace every http(s) image/video URL in ``messages`` (in place) by its bytes.
        The first failure cancels the other fetches and is raised (MediaError)."""
        jobs = []
        for i, m in enumerate(messages):
            content = m.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = _KINDS.get(part.get("type", ""))
                ref = part.get(part.get("type", "")) if kind else None
                if isinstance(ref, dict) and isinstance(ref.get("url"), str) and \
                        is_remote(ref["url"]):
                    part[part["type"]] = ref = dict(ref)  # never mutate the caller's dict
                    jobs.append((ref, kind, f"messages.{i}.content.{j}.{part['type']}"))
        if not jobs:
            return
        tasks = [asyncio.ensure_future(self._one(ref, kind, limits)) for ref, kind, _ in jobs]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t, (_, _, field) in zip(tasks, jobs):
                if t in done and t.exception() is not None:
                    e = t.exception()
                    if isinstance(e, MediaError) and e.param is None:
                        e.param = field
                    raise e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["MediaFetcher"]
