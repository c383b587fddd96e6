"""Operator-set caps on media (bytes, pixels, frames, duration, fetch time) and the per-request
pixel budget. A request may lower a cap (api/request_checks.py:media_limits), never raise it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class MediaError(ValueError):
    """Bad or refused media; the message is safe to show to the client. ``param`` names the
    request field that held it (``messages.0.content.1.image_url``, the dotted style of
    every other refusal) once that is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PixelBudget:
    """Decoded pixels one request may still spend (images plus every kept video frame),
    charged before decoding. One per request; a request is processed on one thread."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def charge(self, pixels: int) -> None:
        if self.used + pixels > self.limit:
            raise MediaError(f"the request's images and videos decode to more than "
                             f"{self.limit} pixels (--max-request-pixels)")
        self.used += pixels


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 20 << 20  # encoded image size
    max_image_pixels: int = 32_000_000  # width * height, checked before decoding (bombs)
    max_video_bytes: int = 64 << 20  # encoded video size
    max_video_frames: int = 32  # frames kept after sampling (rounded down to even)
    video_fps: float = 2.0  # frames sampled per second of video
    max_video_seconds: float = 300.0  # longer videos are refused
    max_video_pixels: int = 128_000_000  # kept frames x width x height, per video
    max_video_decode_s: float = 20.0  # decoding one video's sampled frames, wall time
    max_request_pixels: int = 256_000_000  # decoded pixels per request (with a budget)
    fetch_timeout_s: float = 10.0  # whole download, connect and redirects included
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] | None = None  # exact host names; None = any public host
    allowed_local_media_path: str | None = None  # local paths only under this directory
    allow_private_addresses: bool = False  # allow URLs resolving to private/loopback addresses
    budget: PixelBudget | None = None  # this request's pixel budget (None: per-item caps only)
    resolver: Any = None  # api/media/resolver.py's Resolver (None: getaddrinfo in the caller's
    # thread, as the offline API does)

    def charge(self, pixels: int) -> None:
        if self.budget is not None:
            self.budget.charge(pixels)

    def caps(self) -> dict[str, Any]:
        """The caps as plain values (what a preparation process needs to decode an item
        under them): every field but the budget and the resolver."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("budget", "resolver")}

    @classmethod
    def from_caps(cls, caps: dict[str, Any], budget: PixelBudget | None = None
                  ) -> MediaLimits:
        known = {f.name for f in dataclasses.fields(cls)} - {"budget", "resolver"}
        kw = {k: v for k, v in caps.items() if k in known}
        if kw.get("allowed_domains") is not None:
            kw["allowed_domains"] = tuple(kw["allowed_domains"])
        return cls(**kw, budget=budget)


__all__ = ["MediaError", "MediaLimits", "PixelBudget"]
