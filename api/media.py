"""Fetching and decoding images and videos, with operator-set caps.

Threats designed against (../shared/THREATS.md): SSRF through image URLs (resolve the
host, refuse private/loopback/link-local addresses unless the operator allows them,
re-check every redirect hop), local file reads outside the allowed directory, decoder
DoS (byte, pixel, frame and duration caps set by the operator, never by the request), and
error messages that echo internals (ours name the problem only).
"""
from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import socket
import warnings
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

import numpy as np
from PIL import Image


class MediaError(ValueError):
    """Bad or refused media; the message is safe to show to the client."""


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 20 << 20  # encoded image size
    max_image_pixels: int = 32_000_000  # width * height before decoding (decompression bombs)
    max_video_bytes: int = 64 << 20  # encoded video size
    max_video_frames: int = 32  # frames kept after sampling
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
        return f.read()


def _check_host(host: str, port: int, limits: MediaLimits) -> None:
    host = host.lower().rstrip(".")
    allowed = limits.allowed_domains
    if allowed is not None and host not in {d.lower() for d in allowed}:
        raise MediaError("media URL host is not in the allowed domains")
    if limits.allow_private_addresses or (allowed is not None and host in allowed):
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise MediaError("media URL host cannot be resolved") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if not ip.is_global or ip.is_multicast:
            raise MediaError("media URL resolves to a private or reserved address")


def fetch_bytes(url: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """GET an http(s) URL under the caps; every redirect hop is checked again."""
    import httpx

    for _ in range(limits.max_redirects + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaError("only http(s) media URLs can be fetched")
        _check_host(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), limits)
        try:
            with httpx.stream("GET", url, timeout=limits.fetch_timeout_s,
                              follow_redirects=False) as r:
                if r.is_redirect:
                    url = urljoin(url, r.headers.get("location", ""))
                    continue
                if r.status_code != 200:
                    raise MediaError(f"fetching media failed with HTTP status {r.status_code}")
                buf = bytearray()
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > max_bytes:
                        raise MediaError(f"media is larger than the {max_bytes} byte limit")
                return bytes(buf)
        except httpx.HTTPError:
            raise MediaError("fetching media failed (network error or timeout)") from None
    raise MediaError("too many redirects while fetching media")


def read_media_bytes(src: str, limits: MediaLimits, max_bytes: int) -> bytes:
    if src.startswith("data:"):
        return _data_url(src, max_bytes)
    scheme = urlsplit(src).scheme.lower()
    if scheme in ("http", "https"):
        return fetch_bytes(src, limits, max_bytes)
    if scheme == "file":
        return _local_file(unquote(urlsplit(src).path), limits, max_bytes)
    if scheme == "" and src.startswith("/"):
        return _local_file(src, limits, max_bytes)
    raise MediaError("unsupported media URL (use data:, http(s):, file: or an allowed local path)")


# -- decoding ---------------------------------------------------------------------------------
def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
    except Exception:  # PIL raises many types; never echo them (they can leak addresses)
        raise MediaError("cannot decode image: unsupported format or corrupt data") from None
    w, h = img.size
    if w * h > limits.max_image_pixels:
        raise MediaError(f"image is {w}x{h} pixels, above the {limits.max_image_pixels} pixel limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
        return img.convert("RGB")
    except Exception:
        raise MediaError("cannot decode image: unsupported format or corrupt data") from None


def load_image(src: str | Image.Image, limits: MediaLimits) -> Image.Image:
    """An RGB image from a data/http(s)/file URL, an allowed local path, or a PIL image."""
    if isinstance(src, Image.Image):
        if src.width * src.height > limits.max_image_pixels:
            raise MediaError("image is above the pixel limit")
        return src.convert("RGB") if src.mode != "RGB" else src
    if not isinstance(src, str):
        raise MediaError("an image must be a URL, a path or a PIL image")
    return decode_image(read_media_bytes(src, limits, limits.max_image_bytes), limits)


def load_video(src: str | np.ndarray, limits: MediaLimits) -> tuple[np.ndarray, float]:
    """Frames [T, H, W, 3] uint8 sampled at ``limits.video_fps`` (T even, at most the cap)
    and the sampling rate actually used."""
    if isinstance(src, np.ndarray):
        if src.ndim != 4 or src.shape[-1] != 3 or src.dtype != np.uint8:
            raise MediaError("a video array must be [frames, height, width, 3] uint8")
        frames, fps = src[: limits.max_video_frames], limits.video_fps
    else:
        frames, fps = _decode_video(read_media_bytes(src, limits, limits.max_video_bytes), limits)
    if len(frames) % 2:  # Qwen2-VL's temporal patch holds two frames
        frames = np.concatenate([frames, frames[-1:]])
    return frames, fps


def _decode_video(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, float]:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream")
            stream = container.streams.video[0]
            dur = (float(stream.duration * stream.time_base) if stream.duration
                   else (container.duration or 0) / 1e6)
            if dur > limits.max_video_seconds:
                raise MediaError(f"video is {dur:.0f} s long, above the "
                                 f"{limits.max_video_seconds:.0f} s limit")
            step = 1.0 / limits.video_fps
            frames, next_t = [], 0.0
            for frame in container.decode(stream):
                t = float(frame.pts * stream.time_base) if frame.pts is not None else next_t
                if t > limits.max_video_seconds:
                    raise MediaError("video is longer than the duration limit")
                if t + 1e-6 >= next_t:
                    if frame.width * frame.height > limits.max_image_pixels:
                        raise MediaError("video frames are above the pixel limit")
                    frames.append(frame.to_ndarray(format="rgb24"))
                    next_t += step
                    if len(frames) >= limits.max_video_frames:
                        break
    except MediaError:
        raise
    except Exception:
        raise MediaError("cannot decode video: unsupported format or corrupt data") from None
    if not frames:
        raise MediaError("the video has no decodable frames")
    return np.stack(frames), limits.video_fps
