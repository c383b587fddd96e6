"""Media sources and caps: SSRF guard, local-path containment, decoder limits."""
from __future__ import annotations

import io
import os
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from triptych.api.media import MediaError, MediaLimits, load_image, load_video


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
        def do_GET(self):  # noqa: N802
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


def test_video_frames_sampled_and_capped():
    frames = np.zeros((9, 16, 16, 3), np.uint8)
    out, fps = load_video(frames, MediaLimits(max_video_frames=5))
    assert out.shape[0] == 6 and fps == 2.0  # capped at 5, padded to an even count
