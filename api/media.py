"""Fetching and decoding images and videos, with operator-set caps.

Threats designed against (../shared/THREATS.md): SSRF through media URLs (resolve the host,
refuse private/loopback/link-local/reserved addresses unless the operator allows them,
connect to the very address that was checked so DNS cannot rebind, re-check every redirect
hop), local reads outside the allowed directory (realpath, then containment), decoder DoS
(byte, pixel, frame, duration and download-time caps set by the operator, never by the
request), and error messages that echo internals (ours name the problem only).

Tiny images (1x1) are accepted: the processor's smart_resize scales them up to its
min_pixels, as HF does; only aspect ratios above 200 are refused (api/processor.py).
"""
from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import math
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import numpy as np
from PIL import Image

# Only formats with well-trodden decoders; Image.open would otherwise try every plugin
# (EPS even shells out to Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")
# Hard bound on decoded frames per second of video (sampling keeps far fewer): a stream of
# tiny frames with bogus timestamps cannot make us decode forever.
_MAX_DECODE_FPS = 120


class MediaError(ValueError):
    """Bad or refused media; the message is safe to show to the client."""


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 20 << 20  # encoded image size
    max_image_pixels: int = 32_000_000  # width * height, checked before decoding (bombs)
    max_video_bytes: int = 64 << 20  # encoded video size
    max_video_frames: int = 32  # frames kept after sampling (rounded down to even)
    video_fps: float = 2.0  # frames sampled per second of video
    max_video_seconds: float = 300.0  # longer videos are refused
    fetch_timeout_s: float = 10.0  # whole download, connect included
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] | None = None  # exact host names; None = any public host
    allowed_local_media_path: str | None = None  # local paths only under this directory
    allow_private_addresses: bool = False  # allow URLs resolving to private/loopback addresses


# -- where the bytes come from -------------------------------------------------------------
def _data_url(url: str, max_bytes: int) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise MediaError("data URLs must be base64-encoded (data:<mime>;base64,...)")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaError(f"media is larger than the {max_bytes} byte limit")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 in data URL") from None


def _local_file(path: str, limits: MediaLimits, max_bytes: int) -> bytes:
    root = limits.allowed_local_media_path
    if not root:
        raise MediaError("local media paths are disabled (start with --allowed-local-media-path)")
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)  # resolves '..' and symlinks before the containment check
    if os.path.commonpath([real_root, real]) != real_root:
        raise MediaError("media path is outside the allowed local media directory")
    if not os.path.isfile(real):
        raise MediaError("media file not found")
    if os.path.getsize(real) > max_bytes:
        raise MediaError(f"media is larger than the {max_bytes} byte limit")
    with open(real, "rb") as f:
        return f.read(max_bytes + 1)[:max_bytes]


def _vetted_address(host: str, port: int, check: bool) -> str:
    """One address of ``host``; with ``check``, every address must be public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise MediaError("media URL host cannot be resolved") from None
    addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    for ip in addrs:
        mapped = ip.ipv4_mapped if ip.version == 6 else None  # ::ffff:127.0.0.1 is loopback
        ip = mapped or ip
        if check and (not ip.is_global or ip.is_multicast):
            raise MediaError("media URL resolves to a private or reserved address")
    if not addrs:
        raise MediaError("media URL host cannot be resolved")
    return str(addrs[0])


def _plan_hop(url: str, limits: MediaLimits) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Check one hop's URL; return (URL pinned to the vetted address, headers, extensions).

    NOTE: the URL is parsed once, here, and the request goes to the address checked here:
    httpx never re-parses the client's host (parser mismatches) or re-resolves it (rebinding).
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise MediaError("malformed media URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("only http(s) media URLs can be fetched")
    if not url.isascii():
        raise MediaError("media URLs must be ASCII (percent-encode paths, punycode hosts)")
    if "@" in parts.netloc or any(c in url for c in "\\\r\n\t "):
        raise MediaError("malformed media URL")
    host = parts.hostname.rstrip(".")  # urlsplit lowercases it
    port = port or (443 if parts.scheme == "https" else 80)
    allowed = limits.allowed_domains
    listed = allowed is not None and host in {d.lower().rstrip(".") for d in allowed}
    if allowed is not None and not listed:
        raise MediaError("media URL host is not in the allowed domains")
    ip = _vetted_address(host, port, check=not (limits.allow_private_addresses or listed))
    netloc = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    default_port = port == (443 if parts.scheme == "https" else 80)
    name = f"[{host}]" if ":" in host else host  # IPv6 literal
    headers = {"Host": name if default_port else f"{name}:{port}"}
    ext = {"sni_hostname": host} if parts.scheme == "https" else {}  # TLS checks the real name
    return pinned, headers, ext


def _status_check(r: Any, max_bytes: int) -> None:
    if r.status_code != 200:
        raise MediaError(f"fetching media failed with HTTP status {r.status_code}")
    size = r.headers.get("content-length", "")
    if size.isdigit() and int(size) > max_bytes:
        raise MediaError(f"media is larger than the {max_bytes} byte limit")


def _append_capped(buf: bytearray, chunk: bytes, max_bytes: int, deadline: float) -> None:
    buf += chunk
    if len(buf) > max_bytes:
        raise MediaError(f"media is larger than the {max_bytes} byte limit")
    if time.monotonic() > deadline:  # httpx timeouts are per read; this bounds the whole
        raise MediaError("fetching media timed out")


def fetch_bytes(url: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """GET an http(s) URL under the caps; every redirect hop is checked again."""
    import httpx

    deadline = time.monotonic() + limits.fetch_timeout_s
    with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=False,
                      trust_env=False) as client:  # no env proxies: we pin the address
        for _ in range(limits.max_redirects + 1):
            target, headers, ext = _plan_hop(url, limits)
            try:
                with client.stream("GET", target, headers=headers, extensions=ext) as r:
                    if r.is_redirect:
                        url = urljoin(url, r.headers.get("location", ""))
                        continue
                    _status_check(r, max_bytes)
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        _append_capped(buf, chunk, max_bytes, deadline)
                    return bytes(buf)
            except httpx.HTTPError:
                raise MediaError("fetching media failed (network error or timeout)") from None
    raise MediaError("too many redirects while fetching media")


async def afetch_bytes(url: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """`fetch_bytes` for event loops: name resolution runs in a worker thread."""
    import asyncio

    import httpx

    deadline = time.monotonic() + limits.fetch_timeout_s
    async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=False,
                                 trust_env=False) as client:
        for _ in range(limits.max_redirects + 1):
            target, headers, ext = await asyncio.to_thread(_plan_hop, url, limits)
            try:
                async with client.stream("GET", target, headers=headers, extensions=ext) as r:
                    if r.is_redirect:
                        url = urljoin(url, r.headers.get("location", ""))
                        continue
                    _status_check(r, max_bytes)
                    buf = bytearray()
                    async for chunk in r.aiter_bytes():
                        _append_capped(buf, chunk, max_bytes, deadline)
                    return bytes(buf)
            except httpx.HTTPError:
                raise MediaError("fetching media failed (network error or timeout)") from None
    raise MediaError("too many redirects while fetching media")


def read_media_bytes(src: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """Encoded bytes of a data:, http(s):, file: URL or an allowed absolute local path."""
    if src.startswith("data:"):
        return _data_url(src, max_bytes)
    scheme = urlsplit(src).scheme.lower()
    if scheme in ("http", "https"):
        return fetch_bytes(src, limits, max_bytes)
    if scheme == "file":
        parts = urlsplit(src)
        if parts.netloc not in ("", "localhost"):
            raise MediaError("file: URLs must name a local path")
        return _local_file(unquote(parts.path), limits, max_bytes)
    if scheme == "" and src.startswith("/"):
        return _local_file(src, limits, max_bytes)
    raise MediaError("unsupported media URL (use data:, http(s):, file: or an allowed local path)")


# -- images -----------------------------------------------------------------------------------
def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB as HF's processors see it: transparency is composited onto white."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)),
                                     rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    try:  # PIL raises many types; never echo them (they can leak addresses)
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError(f"image is above the {limits.max_image_pixels} pixel limit") from None
    except Exception:  # noqa: BLE001 - any decoder failure is the client's bad bytes
        raise MediaError("cannot decode image: unsupported format or corrupt data") from None
    w, h = img.size
    # NOTE: checked from the header before any pixel is decoded; Pillow's own global guard
    # (Image.MAX_IMAGE_PIXELS) is process-wide state, so it only backs this up.
    if w * h > limits.max_image_pixels:
        raise MediaError(f"image is {w}x{h} pixels, above the {limits.max_image_pixels} pixel limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
            return _to_rgb(img)
    except Exception:  # noqa: BLE001
        raise MediaError("cannot decode image: unsupported format or corrupt data") from None


def load_image(src: str | Image.Image, limits: MediaLimits) -> Image.Image:
    """An RGB image from a data/http(s)/file URL, an allowed local path, or a PIL image."""
    if isinstance(src, Image.Image):
        if src.width * src.height > limits.max_image_pixels:
            raise MediaError(f"image is above the {limits.max_image_pixels} pixel limit")
        return _to_rgb(src)
    if not isinstance(src, str):
        raise MediaError("an image must be a URL, a path or a PIL image")
    return decode_image(read_media_bytes(src, limits, limits.max_image_bytes), limits)


# -- videos -----------------------------------------------------------------------------------
def _frame_cap(limits: MediaLimits) -> int:
    # Even, so frames fill whole temporal patches of 2; a cap of 1 keeps 1 frame (padded).
    return max(1, limits.max_video_frames - limits.max_video_frames % 2)


def _pad_even(frames: np.ndarray) -> np.ndarray:
    # Qwen2-VL's temporal patch holds two frames: repeat the last one, as HF does.
    return np.concatenate([frames, frames[-1:]]) if len(frames) % 2 else frames


def load_video(src: str | np.ndarray, limits: MediaLimits) -> tuple[np.ndarray, float]:
    """Frames [T, H, W, 3] uint8 sampled at ``limits.video_fps`` over the whole video (T even,
    at most the frame cap; a long video is sampled more sparsely) and the rate actually used.

    An ndarray is taken as frames already sampled at ``video_fps``.
    """
    if isinstance(src, np.ndarray):
        if src.ndim != 4 or src.shape[-1] != 3 or src.dtype != np.uint8 or not len(src):
            raise MediaError("a video array must be [frames, height, width, 3] uint8")
        if src.shape[1] * src.shape[2] > limits.max_image_pixels:
            raise MediaError("video frames are above the pixel limit")
        n, cap = len(src), _frame_cap(limits)
        if n <= cap:
            return _pad_even(src), limits.video_fps
        idx = np.linspace(0, n, cap, endpoint=False).astype(np.int64)  # uniform, like HF
        return _pad_even(src[idx]), limits.video_fps * cap / n
    if not isinstance(src, str):
        raise MediaError("a video must be a URL, a path or a frame array")
    return decode_video(read_media_bytes(src, limits, limits.max_video_bytes), limits)


def decode_video(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, float]:
    """``load_video`` of encoded bytes already read (the processor hashes them first)."""
    frames, fps = _decode_video(data, limits)
    return _pad_even(frames), fps


def _decode_video(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, float]:
    import av

    cap = _frame_cap(limits)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream")
            stream = container.streams.video[0]
            cc = stream.codec_context
            if cc.width * cc.height > limits.max_image_pixels:
                raise MediaError("video frames are above the pixel limit")
            dur = (float(stream.duration * stream.time_base) if stream.duration
                   else (container.duration or 0) / 1e6)
            if dur > limits.max_video_seconds:
                raise MediaError(f"video is {dur:.0f} s long, above the "
                                 f"{limits.max_video_seconds:.0f} s limit")
            # Spread the samples over the whole video: video_fps, or fewer when capped.
            want = min(cap, max(1, math.floor(dur * limits.video_fps)))
            fps = want / dur if dur > 0 else limits.video_fps
            max_decoded = int(max(dur, 1.0) * _MAX_DECODE_FPS) + 1
            frames: list[np.ndarray] = []
            t0, next_t = None, 0.0
            for i, frame in enumerate(container.decode(stream)):
                if i >= max_decoded:
                    raise MediaError("the video has more frames than its duration allows")
                t = float(frame.pts * stream.time_base) if frame.pts is not None else next_t
                t0 = t if t0 is None else t0
                t -= t0
                if t > limits.max_video_seconds:
                    raise MediaError("video is longer than the duration limit")
                if t >= next_t - 1e-3:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    next_t += 1.0 / fps
                    if len(frames) >= (want if dur > 0 else cap):
                        break
    except MediaError:
        raise
    except Exception:  # noqa: BLE001 - PyAV/FFmpeg errors: never echoed
        raise MediaError("cannot decode video: unsupported format or corrupt data") from None
    if not frames:
        raise MediaError("the video has no decodable frames")
    return np.stack(frames), fps
