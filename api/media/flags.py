"""``triptych serve``'s media flags (the batch jobs' in-process app takes the same), and
what they make: the MediaLimits every request is decoded under, and how many preparation
processes (api/prep_pool.py) stand beside P0."""
from __future__ import annotations

import argparse
import json
import os

from triptych.api.media.limits import MediaLimits


def add_media_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("media")
    m.add_argument("--allowed-media-domains", "--allowed-domains", dest="allowed_media_domains",
                   default=None,
                   help="comma-separated hosts media URLs may come from (exact match; such "
                        "hosts may resolve to private addresses); unset: any public host")
    m.add_argument("--allow-private-media-urls", action="store_true",
                   help="let media URLs resolve to private/loopback addresses (unsafe on "
                        "shared hosts)")
    m.add_argument("--max-image-pixels", type=int, default=32_000_000,
                   help="largest decoded image, or video frame (width x height)")
    m.add_argument("--max-video-pixels", type=int, default=128_000_000,
                   help="most decoded pixels per video (kept frames x width x height)")
    m.add_argument("--max-request-pixels", type=int, default=256_000_000,
                   help="most decoded pixels per request (all images and video frames)")
    m.add_argument("--max-media-bytes", type=int, default=20 << 20,
                   help="largest encoded image or video, bytes")
    m.add_argument("--video-fps", type=float, default=2.0,
                   help="frames sampled per video second (a request may ask for fewer)")
    m.add_argument("--max-video-frames", type=int, default=16,
                   help="frames kept per video (a request may ask for fewer)")
    m.add_argument("--media-io-kwargs", default=None,
                   help="vLLM's spelling of the two above: JSON such as "
                        "'{\"video\": {\"num_frames\": 32, \"fps\": 1}}'")
    m.add_argument("--max-video-seconds", type=float, default=120.0,
                   help="longer videos are refused")
    m.add_argument("--mm-processor-workers", type=int, default=-1,
                   help="preparation processes beside P0 that decode, process and hash "
                        "images and videos (at a lower CPU priority than serving; pixels go "
                        "to the workers through shared memory; started at the first image); "
                        "one prepares ~25 1080p photos a second at Qwen2-VL's hub setting: "
                        "raise it by one per ~25 a second the GPU's vision tower takes; 0: "
                        "in P0's threads (no decode deadline); -1 (default): 1 on a CPU "
                        "engine, else the cores less one, at most 8")
    m.add_argument("--max-image-decode-seconds", type=float, default=10.0,
                   help="CPU time a preparation process may take for one image (decode + "
                        "processor; time spent waiting for a busy CPU does not count, up to "
                        "ten times this in wall time); past it the process is killed and "
                        "replaced and the request gets a 400 (videos: "
                        "--max-video-decode-seconds plus this)")
    m.add_argument("--mm-processor-memory", type=float, default=4.0,
                   help="GiB of resident memory a preparation process may reach while "
                        "preparing one item; above it the process is killed and replaced "
                        "and the request gets a 400")
    m.add_argument("--max-video-decode-seconds", type=float, default=20.0,
                   help="wall time to decode one video's sampled frames (decoding starts at "
                        "the keyframe before each sample); longer is refused")
    m.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds for one media URL, from waiting for a fetch slot to the "
                        "last byte")
    m.add_argument("--max-concurrent-media-fetches", type=int, default=32,
                   help="media URLs fetched at once, server-wide (text requests never wait "
                        "on them)")
    m.add_argument("--media-dns-threads", type=int, default=8,
                   help="threads that resolve media URL hosts (their own, so a domain whose "
                        "DNS never answers cannot hold up other fetches)")
    m.add_argument("--media-dns-per-domain", type=int, default=2,
                   help="lookups of one domain (its last two labels) at once; more are "
                        "refused at once")


def video_caps(args: argparse.Namespace) -> tuple[int, float]:
    from triptych.cli import fail

    frames, fps = args.max_video_frames, args.video_fps
    if args.media_io_kwargs:
        try:
            video = json.loads(args.media_io_kwargs).get("video", {})
            frames = int(video.get("num_frames", frames))
            fps = float(video.get("fps", fps))
        except (ValueError, TypeError, AttributeError):
            fail("--media-io-kwargs must be JSON like '{\"video\": {\"num_frames\": 32}}'")
    if frames < 1 or not fps > 0:
        fail("video frames and fps must be positive")
    return frames, fps


def media_limits_from_args(limits: argparse.Namespace, allowed_local_media_path: str | None
                           ) -> MediaLimits:
    """The server's media caps from its flags (``limits``: serve's namespace)."""
    from triptych.api.media.resolver import Resolver

    frames, fps = video_caps(limits)
    return MediaLimits(
        max_image_bytes=limits.max_media_bytes, max_video_bytes=limits.max_media_bytes,
        max_image_pixels=limits.max_image_pixels, max_video_pixels=limits.max_video_pixels,
        max_request_pixels=limits.max_request_pixels, video_fps=fps, max_video_frames=frames,
        max_video_seconds=limits.max_video_seconds, fetch_timeout_s=limits.media_fetch_timeout,
        max_video_decode_s=limits.max_video_decode_seconds,
        allowed_domains=tuple(d.strip() for d in limits.allowed_media_domains.split(","))
        if limits.allowed_media_domains else None,
        allowed_local_media_path=allowed_local_media_path,
        allow_private_addresses=limits.allow_private_media_urls,
        resolver=Resolver(limits.media_dns_threads, limits.media_dns_per_domain))


def prep_workers(flag: int, device: str) -> int:
    """``--mm-processor-workers``: as given, or by default one on a CPU engine (it takes
    the cores; the process runs at a lower priority) and the cores less one, at most 8,
    beside a GPU engine."""
    if flag >= 0:
        return flag
    from triptych.engine.device.platform import resolve_device

    if resolve_device(device).type == "cpu":
        return 1
    return max(1, min(8, len(os.sched_getaffinity(0)) - 1))


__all__ = ["add_media_args", "media_limits_from_args", "prep_workers", "video_caps"]
