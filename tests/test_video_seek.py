"""Video decoding decodes what its samples need (issue 36, row 10): a long, high-rate
clip sampled at a few frames costs about a keyframe interval per sample instead of every
frame, the frames are exactly those a full decode would pick, and a per-item deadline
bounds a clip that cannot be skipped through (one keyframe)."""
from __future__ import annotations

import io
import math

import av
import numpy as np
import pytest
from triptych.api.media.decode import MediaError, MediaLimits, _decode_video

SECONDS, FPS, SIZE = 20, 60, 64


def clip(gop: int) -> bytes:
    """SECONDS at FPS, every frame different (its index in the top rows), a keyframe every
    ``gop`` frames."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=FPS)
        s.width = s.height = SIZE
        s.pix_fmt = "yuv420p"
        s.codec_context.gop_size = gop
        for i in range(SECONDS * FPS):
            arr = np.zeros((SIZE, SIZE, 3), np.uint8)
            arr[:16] = (i * 7) % 256
            arr[16:, :, 1] = i // 8
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def full_decode_pick(data: bytes, fps: float, want: int) -> np.ndarray:
    """The oracle: decode every frame, keep the first at or after each k / fps."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        frames = [(float(f.pts * s.time_base), f.to_ndarray(format="rgb24"))
                  for f in c.decode(s)]
    t0 = frames[0][0]
    out, next_t = [], 0.0
    for t, arr in frames:
        if t - t0 >= next_t - 1e-3 and len(out) < want:
            out.append(arr)
            next_t += 1.0 / fps
    return np.stack(out)


@pytest.mark.parametrize("gop", [12, 60])
def test_sampling_decodes_about_a_keyframe_interval_per_sample(gop):
    data = clip(gop)
    limits = MediaLimits(max_video_frames=8, video_fps=2.0)
    frames, fps, decoded = _decode_video(data, limits)
    assert len(frames) == 8 and math.isclose(fps, 8 / SECONDS)
    assert np.array_equal(frames, full_decode_pick(data, fps, 8))
    # every frame of the clip was decoded before: SECONDS * FPS = 1200
    assert decoded <= 8 * gop < SECONDS * FPS // 2, decoded


def test_one_keyframe_decodes_linearly_and_the_deadline_bounds_it():
    data = clip(10_000)  # no keyframe after the first: nothing to skip to
    frames, fps, decoded = _decode_video(data, MediaLimits(max_video_frames=8))
    assert np.array_equal(frames, full_decode_pick(data, fps, 8))
    assert decoded > SECONDS * FPS * 3 // 4
    with pytest.raises(MediaError, match="--max-video-decode-seconds"):
        _decode_video(data, MediaLimits(max_video_frames=8, max_video_decode_s=1e-6))
