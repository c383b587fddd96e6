"""Decoding images and videos under operator-set caps (api/media/limits.py); where the bytes
come from, and the SSRF and path guards, are in api/media/sources.py.

Decoder DoS is designed against (../shared/THREATS.md): byte, pixel, frame, duration caps,
pixels per video and per request, all checked from headers before pixels are decoded, and
set by the operator, never raised by a request. Error messages name the problem and the flag,
never echo decoder internals.

Every image leaves as 8-bit RGB by the rules of api/media/pixels.py (``to_rgb8``: EXIF
orientation, transparency on white, 16-bit and 32-bit samples scaled, CMYK through its ICC
profile, the first frame of an animation).

Tiny images (1x1) are accepted: the processor's smart_resize scales them up to its
min_pixels, as HF does; only aspect ratios above 200 are refused (api/processor.py).
"""
from __future__ import annotations

import io
import math
import time
import warnings
from typing import Any

import numpy as np
from PIL import Image
from triptych.api.media.limits import MediaError, MediaLimits, PixelBudget
from triptych.api.media.pixels import to_rgb8
from triptych.api.media.sources import afetch_bytes, fetch_bytes, is_remote, read_media_bytes



def _opened_here(names: tuple[str, ...]) -> tuple[str, ...]:
    # NOTE: Image.open(formats=...) raises KeyError for a name no plugin opens, before it
    # tries the rest: Pillow 13 opens MPO through its JPEG plugin and registers no "MPO"
    # opener, which made every GIF, WebP, BMP and TIFF "corrupt". Keep what this Pillow
    # opens (init() registers every plugin; none runs until asked to open).
    Image.init()
    return tuple(n for n in names if n in Image.OPEN)


# Only formats with well-trodden decoders; Image.open would otherwise try every plugin
# (EPS even shells out to Ghostscript).
IMAGE_FORMATS = _opened_here(("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"))
# Hard bound on decoded frames per second of video (sampling keeps far fewer): a stream of
# tiny frames with bogus timestamps cannot make us decode forever.
_MAX_DECODE_FPS = 120

# A source is a URL / path, encoded bytes already fetched (the server fetches http(s)
# media on its own pool first), or decoded media (PIL image, frame array) from Python.


# -- images -----------------------------------------------------------------------------------
def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    try:  # PIL raises many types; never echo them (they can leak addresses)
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError(f"image is above the {limits.max_image_pixels} pixel limit "
                         "(--max-image-pixels)") from None
    except Exception:  # noqa: BLE001 - any decoder failure is the client's bad bytes
        raise MediaError("cannot decode image: unsupported format or corrupt data") from None
    w, h = img.size
    # NOTE: checked from the header before any pixel is decoded; Pillow's own global guard
    # (Image.MAX_IMAGE_PIXELS) is process-wide state, so it only backs this up.
    if w * h > limits.max_image_pixels:
        raise MediaError(f"image is {w}x{h} pixels, above the {limits.max_image_pixels} pixel "
                         "limit (--max-image-pixels)")
    limits.charge(w * h)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
            return to_rgb8(img)
    except Exception:  # noqa: BLE001
        raise MediaError("cannot decode image: unsupported format or corrupt data") from None


def load_image(src: str | bytes | Image.Image, limits: MediaLimits) -> Image.Image:
    """An RGB image from a data/http(s)/file URL, an allowed local path, encoded bytes, or a
    PIL image."""
    if isinstance(src, Image.Image):
        if src.width * src.height > limits.max_image_pixels:
            raise MediaError(f"image is above the {limits.max_image_pixels} pixel limit "
                             "(--max-image-pixels)")
        limits.charge(src.width * src.height)
        return to_rgb8(src)
    if isinstance(src, bytes):
        if len(src) > limits.max_image_bytes:
            raise MediaError(f"media is larger than the {limits.max_image_bytes} byte limit "
                             "(--max-media-bytes)")
        return decode_image(src, limits)
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


def _check_video_pixels(frames: int, w: int, h: int, limits: MediaLimits) -> None:
    if w * h > limits.max_image_pixels:
        raise MediaError(f"video frames are {w}x{h}, above the {limits.max_image_pixels} "
                         "pixel limit (--max-image-pixels)")
    if frames * w * h > limits.max_video_pixels:
        raise MediaError(f"the video decodes to {frames} frames of {w}x{h}, above the "
                         f"{limits.max_video_pixels} pixel limit per video (--max-video-pixels)")
    limits.charge(frames * w * h)


def load_video(src: str | bytes | np.ndarray, limits: MediaLimits, pad: bool = True
               ) -> tuple[np.ndarray, float]:
    """Frames [T, H, W, 3] uint8 sampled at ``limits.video_fps`` over the whole video (T even
    unless ``pad=False``, at most the frame cap; a long video is sampled more sparsely) and
    the rate actually used.

    An ndarray is taken as frames already sampled at ``video_fps``. ``pad=False``: the
    frames as sampled (the processor pads them itself and needs their count: Qwen3-VL's
    timestamps).
    """
    even = _pad_even if pad else (lambda f: f)
    if isinstance(src, np.ndarray):
        if src.ndim != 4 or src.shape[-1] != 3 or src.dtype != np.uint8 or not len(src):
            raise MediaError("a video array must be [frames, height, width, 3] uint8")
        n, cap = len(src), _frame_cap(limits)
        _check_video_pixels(min(n, cap), src.shape[2], src.shape[1], limits)
        if n <= cap:
            return even(src), limits.video_fps
        idx = np.linspace(0, n, cap, endpoint=False).astype(np.int64)  # uniform, like HF
        return even(src[idx]), limits.video_fps * cap / n
    if isinstance(src, bytes):
        if len(src) > limits.max_video_bytes:
            raise MediaError(f"media is larger than the {limits.max_video_bytes} byte limit "
                             "(--max-media-bytes)")
        data = src
    elif isinstance(src, str):
        data = read_media_bytes(src, limits, limits.max_video_bytes)
    else:
        raise MediaError("a video must be a URL, a path or a frame array")
    return decode_video(data, limits, pad)


def decode_video(data: bytes, limits: MediaLimits, pad: bool = True
                 ) -> tuple[np.ndarray, float]:
    """``load_video`` of encoded bytes already read (the processor hashes them first)."""
    frames, fps, _ = _decode_video(data, limits)
    return (_pad_even(frames) if pad else frames), fps


def _decode_video(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, float, int]:
    """(frames, the rate sampled at, how many frames were decoded to get them).

    The samples are spread over the whole video (``video_fps``, fewer when capped); frame
    k is the first one at or after k / fps. Only what those frames need is decoded: the
    packets are read first (cheap: no pixels), then decoding starts at the last keyframe
    before each sample and skips whole stretches between samples, so a 2-minute clip at
    120 fps costs about one keyframe interval per sample, not 14,400 frames. Decoding stops
    at ``max_video_decode_s`` (a video with one keyframe still decodes linearly)."""
    import av

    cap = _frame_cap(limits)
    started = time.monotonic()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream")
            stream = container.streams.video[0]
            cc = stream.codec_context
            if cc.width * cc.height > limits.max_image_pixels:
                raise MediaError(f"video frames are {cc.width}x{cc.height}, above the "
                                 f"{limits.max_image_pixels} pixel limit (--max-image-pixels)")
            dur = (float(stream.duration * stream.time_base) if stream.duration
                   else (container.duration or 0) / 1e6)
            if dur > limits.max_video_seconds:
                raise MediaError(f"video is {dur:.0f} s long, above the "
                                 f"{limits.max_video_seconds:.0f} s limit "
                                 "(--max-video-seconds)")
            # Spread the samples over the whole video: video_fps, or fewer when capped.
            want = min(cap, max(1, math.floor(dur * limits.video_fps)))
            fps = want / dur if dur > 0 else limits.video_fps
            want = want if dur > 0 else cap
            _check_video_pixels(want + want % 2, cc.width, cc.height, limits)
            max_decoded = int(max(dur, 1.0) * _MAX_DECODE_FPS) + 1
            packets = []
            for p in container.demux(stream):
                if p.size:
                    packets.append(p)
                    if len(packets) > max_decoded:
                        raise MediaError("the video has more frames than its duration "
                                         "allows")
            frames, decoded = _sample(cc, packets, stream.time_base, fps, want, limits,
                                      started)
    except MediaError:
        raise
    except Exception:  # noqa: BLE001 - PyAV/FFmpeg errors: never echoed
        raise MediaError("cannot decode video: unsupported format or corrupt data") from None
    if not frames:
        raise MediaError("the video has no decodable frames")
    return np.stack(frames), fps, decoded


def _sample(cc: Any, packets: list, time_base: Any, fps: float, want: int,
            limits: MediaLimits, started: float) -> tuple[list[np.ndarray], int]:
    """Decode ``packets`` (decode order) for ``want`` frames at ``fps``, jumping to the last
    keyframe before the next sample whenever that lies ahead (the decoder is flushed: what
    it still held is older than that keyframe, so older than the sample)."""
    seekable = all(p.pts is not None for p in packets)
    t0 = float(min(p.pts for p in packets) * time_base) if seekable and packets else None
    keys = [(float(p.pts * time_base) - t0, i) for i, p in enumerate(packets)
            if p.is_keyframe] if t0 is not None else []
    frames: list[np.ndarray] = []
    decoded, next_t, i = 0, 0.0, 0
    while True:
        jump = next((k for t, k in reversed(keys) if t <= next_t + 1e-3), 0)
        if jump > i:
            cc.flush_buffers()
            i = jump
        packet = packets[i] if i < len(packets) else None  # None: drain the decoder
        i += 1
        for frame in cc.decode(packet):
            decoded += 1
            if time.monotonic() - started > limits.max_video_decode_s:
                raise MediaError(f"decoding the video took longer than "
                                 f"{limits.max_video_decode_s:g} s (--max-video-decode-seconds)"
                                 "; send a shorter, smaller or more often keyframed video")
            t = float(frame.pts * time_base) if frame.pts is not None else next_t
            t0 = t if t0 is None else t0
            t -= t0
            if t > limits.max_video_seconds:
                raise MediaError("video is longer than the duration limit")
            if (frame.width, frame.height) != (cc.width, cc.height):
                # NOTE: the caps were checked against the header's size
                raise MediaError("the video's frame size changes mid-stream")
            if t >= next_t - 1e-3:
                frames.append(frame.to_ndarray(format="rgb24"))
                next_t += 1.0 / fps
                if len(frames) >= want:
                    return frames, decoded
        if packet is None:
            return frames, decoded


__all__ = ["IMAGE_FORMATS", "MediaError", "MediaLimits", "PixelBudget", "afetch_bytes",
           "decode_image", "fetch_bytes", "is_remote", "load_image", "load_video",
           "read_media_bytes"]
