"""Media sources and caps: SSRF guard, local-path containment, decoder limits."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image
from triptych.api.media.decode import (
    MediaError,
    MediaLimits,
    afetch_bytes,
    fetch_bytes,
    load_image,
    load_video,
)


def png_bytes(w: int = 8, h: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    d = tmp_path_factory.mktemp("www")
    (d / "img.png").write_bytes(png_bytes())
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(d)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def redirector(http_root):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{http_root}/img.png")
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_loopback_urls_refused_by_default(http_root):
    for host in ("127.0.0.1", "localhost"):
        with pytest.raises(MediaError, match="private"):
            load_image(f"http://{host}:{http_root}/img.png", MediaLimits())


def test_allow_list_and_private_switch(http_root):
    ok = load_image(f"http://127.0.0.1:{http_root}/img.png",
                    MediaLimits(allowed_domains=("127.0.0.1",)))
    assert ok.size == (8, 8)
    with pytest.raises(MediaError, match="allowed domains"):
        load_image(f"http://localhost:{http_root}/img.png",
                   MediaLimits(allowed_domains=("127.0.0.1",)))
    assert load_image(f"http://localhost:{http_root}/img.png",
                      MediaLimits(allow_private_addresses=True)).size == (8, 8)


def test_redirect_hop_is_checked_again(redirector):
    # The first hop is allow-listed; the redirect to localhost is not.
    with pytest.raises(MediaError, match="allowed domains"):
        load_image(f"http://127.0.0.1:{redirector}/x", MediaLimits(allowed_domains=("127.0.0.1",)))


def test_byte_cap_on_download(http_root):
    with pytest.raises(MediaError, match="byte limit"):
        load_image(f"http://127.0.0.1:{http_root}/img.png",
                   MediaLimits(allowed_domains=("127.0.0.1",), max_image_bytes=10))


def test_local_paths_contained(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    os.symlink(tmp_path / "secret.png", root / "link.png")
    lim = MediaLimits(allowed_local_media_path=str(root))
    assert load_image(str(root / "a.png"), lim).size == (8, 8)
    assert load_image(f"file://{root}/a.png", lim).size == (8, 8)
    for bad in (f"{root}/../secret.png", str(root / "link.png"), str(tmp_path / "secret.png")):
        with pytest.raises(MediaError, match="outside"):
            load_image(bad, lim)
    with pytest.raises(MediaError, match="disabled"):
        load_image(str(root / "a.png"), MediaLimits())


def test_decoder_caps():
    with pytest.raises(MediaError, match="pixel limit"):
        load_image("data:image/png;base64," + __import__("base64").b64encode(
            png_bytes(400, 300)).decode(), MediaLimits(max_image_pixels=100_000))
    with pytest.raises(MediaError, match="unsupported"):
        load_image("gopher://x", MediaLimits())
    tiny = load_image(Image.new("RGB", (1, 1)), MediaLimits())
    assert tiny.size == (1, 1)  # the processor resizes it up to its minimum


def test_video_array_capped_to_an_even_count():
    frames = np.arange(9, dtype=np.uint8)[:, None, None, None] * np.ones((1, 16, 16, 3), np.uint8)
    out, fps = load_video(frames, MediaLimits(max_video_frames=5))
    # Never above the operator's cap: 5 rounds down to 4, spread over all 9 frames.
    assert out.shape[0] == 4 and out[:, 0, 0, 0].tolist() == [0, 2, 4, 6] and fps == 2.0 * 4 / 9
    out, fps = load_video(frames[:3], MediaLimits())
    assert out[:, 0, 0, 0].tolist() == [0, 1, 2, 2] and fps == 2.0  # last frame repeated


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def make_video(seconds: float, fps: int = 10, size: int = 64) -> bytes:
    """An mp4 whose frame i is a flat color with red = 10 * i (so samples can be told apart)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        s.options = {"qscale": "2"}
        for i in range(int(seconds * fps)):
            rgb = np.full((size, size, 3), (10 * i % 250, 128, 64), np.uint8)
            for pkt in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return buf.getvalue()


def test_data_url_round_trip():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out = load_image(data_url(buf.getvalue()), MediaLimits())
    assert out.mode == "RGB" and out.size == (20, 12) and out.tobytes() == img.tobytes()
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # transparent -> white, like HF
    assert load_image(rgba, MediaLimits()).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("url, msg", [
    ("data:image/png;base64,!!!not-base64!!!", "invalid base64"),
    ("data:image/png,rawbytes", "base64-encoded"),
    ("ftp://example.com/a.png", "unsupported media URL"),
    ("relative/path.png", "unsupported media URL"),
    ("http://user:pw@example.com/a.png", "malformed"),
    ("http://example.com:99999/a.png", "malformed"),
    ("http://example.com\\@127.0.0.1/a.png", "malformed"),  # parser-mismatch bait
    ("http://exämple.com/a.png", "ASCII"),
    ("file://example.com/etc/passwd", "local path"),
    ("http://[::1]/a.png", "private"),
    ("http://169.254.169.254/latest/meta-data/", "private"),  # cloud metadata
])
def test_refused_urls(url, msg):
    with pytest.raises(MediaError, match=msg):
        load_image(url, MediaLimits())


def test_decompression_bomb_and_corrupt_bytes_refused():
    buf = io.BytesIO()
    Image.new("L", (5000, 5000)).save(buf, format="PNG")  # 25 MP in ~25 KB
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(MediaError, match="pixel limit"):
        load_image(data_url(buf.getvalue()), MediaLimits(max_image_pixels=4_000_000))
    png = png_bytes(64, 64)
    for bad in (png[: len(png) // 2], b"\x89PNG garbage", b"%!PS-Adobe-3.0 EPSF-3.0\n"):
        with pytest.raises(MediaError, match="cannot decode image") as e:
            load_image(data_url(bad), MediaLimits())
        assert "0x" not in str(e.value) and "PIL" not in str(e.value)  # no internals echoed


def test_video_decoded_and_sampled_over_its_length():
    url = data_url(make_video(2.0), "video/mp4")
    frames, fps = load_video(url, MediaLimits(video_fps=2.0))
    # 2 s at 2 fps -> frames 0, 5, 10, 15 of the 10 fps source.
    assert frames.shape == (4, 64, 64, 3) and frames.dtype == np.uint8 and fps == 2.0
    reds = frames[:, 32, 32, 0].astype(int)
    assert all(abs(r - 10 * i) <= 6 for r, i in zip(reds, (0, 5, 10, 15))), reds
    frames, fps = load_video(url, MediaLimits(video_fps=2.0, max_video_frames=3))
    assert frames.shape[0] == 2 and fps == 1.0  # capped: sampled more sparsely, still even
    assert abs(int(frames[1, 32, 32, 0]) - 100) <= 6


def test_bad_and_long_videos_refused():
    with pytest.raises(MediaError, match="above the 1 s limit"):
        load_video(data_url(make_video(2.0), "video/mp4"), MediaLimits(max_video_seconds=1.0))
    with pytest.raises(MediaError, match="cannot decode video"):
        load_video(data_url(b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 200, "video/mp4"),
                   MediaLimits())
    with pytest.raises(MediaError, match="pixel limit"):
        load_video(data_url(make_video(0.4), "video/mp4"), MediaLimits(max_image_pixels=1000))


def test_ipv4_mapped_loopback_refused(http_root):
    with pytest.raises(MediaError, match="private"):
        load_image(f"http://[::ffff:127.0.0.1]:{http_root}/img.png", MediaLimits())


def test_fetch_status_and_async_variant(http_root):
    lim = MediaLimits(allow_private_addresses=True)
    with pytest.raises(MediaError, match="HTTP status 404"):
        fetch_bytes(f"http://127.0.0.1:{http_root}/missing.png", lim, 1000)
    data = asyncio.run(afetch_bytes(f"http://localhost:{http_root}/img.png", lim, 1000))
    assert data == png_bytes()
    with pytest.raises(MediaError, match="private"):
        asyncio.run(afetch_bytes(f"http://localhost:{http_root}/img.png", MediaLimits(), 1000))


def test_symlink_swap_race_never_reads_outside_the_root(tmp_path):
    """A directory under the root flips to a link to outside/ and back while files are
    read through it: the walk with O_NOFOLLOW either reads the inside file or refuses."""
    from triptych.api.media.sources import local_file

    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.bin").write_bytes(b"inside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f.bin").write_bytes(b"SECRET")
    os.symlink(tmp_path / "outside", root / "link")
    lim = MediaLimits(allowed_local_media_path=str(root))
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.rename(root / "d", root / "parked")
            os.rename(root / "link", root / "d")
            os.rename(root / "d", root / "link")
            os.rename(root / "parked", root / "d")

    t = threading.Thread(target=swap)
    t.start()
    seen = set()
    try:
        for _ in range(3000):
            try:
                seen.add(local_file(str(root / "d" / "f.bin"), lim, 100))
            except MediaError as e:
                seen.add("outside" if "outside" in str(e) else "missing")
    finally:
        stop.set()
        t.join(10)
    assert b"SECRET" not in seen and b"inside" in seen


def test_local_file_refusals(tmp_path):
    from triptych.api.media.sources import local_file

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "big.bin").write_bytes(b"x" * 200)
    os.mkfifo(root / "fifo")
    lim = MediaLimits(allowed_local_media_path=str(root))
    for path, msg in ((root / "sub", "not a regular file"), (root / "fifo", "not a regular"),
                      (root / "nope.png", "not found"), (root / "big.bin", "byte limit"),
                      (str(root) + "/./sub/../big.bin", "byte limit"), (root, "outside")):
        with pytest.raises(MediaError, match=msg):
            local_file(str(path), lim, 100)


def test_pixel_caps_per_video_and_per_request():
    from triptych.api.media.decode import PixelBudget

    video = make_video(2.0, size=64)  # 4 frames kept at 2 fps
    with pytest.raises(MediaError, match="--max-video-pixels"):
        load_video(data_url(video, "video/mp4"), MediaLimits(max_video_pixels=3 * 64 * 64))
    lim = MediaLimits(budget=PixelBudget(4 * 64 * 64 + 8 * 8))
    load_video(video, lim)  # encoded bytes are a source too
    load_image(png_bytes(8, 8), lim)
    with pytest.raises(MediaError, match="--max-request-pixels"):
        load_image(png_bytes(8, 8), lim)  # the request's budget is spent
    frames = np.zeros((6, 32, 32, 3), np.uint8)
    with pytest.raises(MediaError, match="per video"):
        load_video(frames, MediaLimits(max_video_pixels=5 * 32 * 32))


def test_async_fetch_has_one_deadline():
    """A server that trickles a byte every 0.2 s for 60 s: the fetch ends at its deadline
    (1 s), not at the per-read timeout times the number of reads, i.e. while the server is
    still sending."""
    import time

    still_sending = threading.Event()  # cleared when a trickle ran to its end

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(300):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.2)
                still_sending.clear()
            except OSError:
                pass

        def log_message(self, *a):
            pass

    still_sending.set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    lim = MediaLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=1.0)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/x"
    try:
        for fetch in (lambda: asyncio.run(afetch_bytes(url, lim, 10_000)),
                      lambda: fetch_bytes(url, lim, 10_000)):
            with pytest.raises(MediaError, match="--media-fetch-timeout"):
                fetch()
            assert still_sending.is_set()
    finally:
        httpd.shutdown()
