"""Helpers for the server tests: a real `triptych serve` subprocess on 127.0.0.1, small
images and videos, message builders. (Not a conftest: imported by the server test modules.)
"""
from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def img(seed: int, w: int = 56, h: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def make_video(seconds: float, fps: int = 4, size: int = 56) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            arr = np.full((size, size, 3), (i * 37) % 256, dtype=np.uint8)
            arr[:, : size // 2, 1] = 200
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def image_chat(text: str, *images: Image.Image) -> list[dict]:
    """One user message: the PIL images, then the text (the offline API's chat form)."""
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def text_part(t: str) -> dict:
    return {"type": "text", "text": t}


def separated_prompt(offline, candidates: list[list[dict]], max_tokens: int,
                     margin: float = 1e-4) -> tuple[list[dict], str]:
    """The first conversation whose greedy path is well separated (at every step the top
    token beats the runner-up by more than ``margin`` in logprob) and its text. A resumed
    or recomputed request takes another arithmetic path (a prefill instead of decodes); on
    a near tie (a random tiny model has some) either token is a correct greedy pick, so
    tests that compare a resumed stream with an undisturbed one exclude near ties."""
    from triptych import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for msgs in candidates:
        out = offline.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
        gaps = [abs(a - b) for a, b in (sorted((lp.logprob for lp in d.values()),
                                               reverse=True)[:2] for d in out.logprobs)]
        if min(gaps) > margin:
            return msgs, out.text
    raise AssertionError("no candidate prompt has a well-separated greedy path")


def file_server(directory: Path) -> ThreadingHTTPServer:
    """A local HTTP server for the media-URL tests (127.0.0.1 only); call .shutdown()."""
    import threading

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(directory)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def wait_for(pred, what: str, timeout: float = 60.0, step: float = 0.05):
    """Poll ``pred()`` until it returns something true, and return that. ``timeout`` is a
    hang guard (tens of seconds), never a speed claim: on a slow or busy box the
    condition comes later, and the test still passes."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step)
    return value


def _children(pid: int) -> list[int]:
    """Every descendant of pid (Linux /proc)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    return out + [g for c in out for g in _children(c)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class ServerProc:
    """`python -m triptych serve --model MODEL ARGS...` on a free 127.0.0.1 port. Its log
    goes to a file (a pipe nobody reads would fill up and hang the server)."""

    def __init__(self, model: str | None, log_path: Path, *args: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # the operator's key, when given on the command line: /admin/* and /health's detail
        admin = args[args.index("--admin-api-key") + 1] if "--admin-api-key" in args else None
        self.admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        self.log_path = log_path
        cmd = [sys.executable, "-m", "triptych", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *(["--model", model] if model else []), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 (open for the process lifetime)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError("server did not start:\n" + log_path.read_text()[-4000:])
            time.sleep(0.3)
        self.descendants = _children(self.proc.pid)  # P1 and multiprocessing's helper

    def openai_client(self, timeout: float = 600.0):
        """The real `openai` client on this server, without retries (a test sees every error)."""
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0,
                             timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def cleanup_descendants(self) -> None:
        """Last resort for a failed test: end the processes this server started, by pid."""
        for pid in self.descendants:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    def worker_pids(self) -> dict[str, int]:
        """Live worker processes by "<pool>-<index>" (from /health)."""
        h = httpx.get(self.base + "/health", headers=self.admin_headers, timeout=5).json()
        return {f"{pool}-{w['index']}": w["pid"] for pool, p in h["pools"].items()
                for w in p["workers"] if w["state"] == "up"}

    def engine_pid(self) -> int:
        """The colocated engine worker (P1) of a single-worker server."""
        (pid,) = self.worker_pids().values()
        return pid

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.base + "/metrics").text):
            for s in fam.samples:
                out.setdefault(s.name, s.value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (e.g.
        every pool's ``triptych:kv_transfer_bytes_total``)."""
        total = 0.0
        for fam in text_string_to_metric_families(httpx.get(self.base + "/metrics").text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def wait_running(self, value: float, timeout: float) -> float:
        """Poll the running-requests gauge until it equals value (or time runs out)."""
        deadline = time.time() + timeout
        while True:
            v = self.metrics()["triptych:num_requests_running"]
            if v == value or time.time() > deadline:
                return v
            time.sleep(0.1)


def module_server(model: str | None, tmp_path_factory, *args: str) -> Iterator[ServerProc]:
    """A module fixture's server: ``yield from module_server(...)``; killed (no clean
    shutdown) and every process it started ended when the module is done."""
    s = ServerProc(model, tmp_path_factory.mktemp("log") / "serve.log", *args)
    try:
        yield s
    finally:
        s.stop(signal.SIGKILL)
        s.cleanup_descendants()
