"""Batch jobs at a keyed server and run-batch's input (issue 36, rows 8-9): --server takes an
API key (a 401 says so), and run-batch reads lines of bounded length into a window bounded
in bytes.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triptych.jobs.driver import ordered_map

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import img, module_server  # noqa: E402

TIMEOUT = 300  # seconds any one CLI run may take here
KEYS = {"alice": "key-alice-0123456789"}


def cli(command: str, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run([sys.executable, "-m", "triptych", command, "--no-progress", *args],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={**base, **(env or {})})


# -- row 8: --api-key for --server -------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(tiny_qwen2_vl: str, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    path.chmod(0o600)
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--api-keys-file", str(path))


def line(cid: str, prompt: str = "hello") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 2, "temperature": 0}})


def results(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_server_mode_sends_the_api_key_and_names_a_401(keyed_server, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("a") + "\n")
    batch = ("-i", str(src), "-o", str(out), "--server", keyed_server.base)
    r = cli("run-batch", *batch)
    assert r.returncode == 2 and "the server refused the API key (HTTP 401)" in r.stderr, r.stderr
    assert "pass --api-key or set OPENAI_API_KEY" in r.stderr
    r = cli("run-batch", *batch, "--api-key", "wrong-key")
    assert r.returncode == 2 and "(HTTP 401); check --api-key" in r.stderr, r.stderr
    assert "wrong-key" not in r.stderr
    r = cli("run-batch", *batch, "--api-key", KEYS["alice"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(out)[0]["response"]["status_code"] == 200
    r = cli("run-batch", *batch, env={"OPENAI_API_KEY": KEYS["alice"]})
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(out)[0]["response"]["status_code"] == 200
    img(3).save(tmp_path / "page.png")
    r = cli("ocr", str(tmp_path / "page.png"), "-o", str(tmp_path / "ocr"), "--max-tokens", "2",
            "--server", keyed_server.base, "--api-key", KEYS["alice"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "<!-- page 1/1 -->" in (tmp_path / "ocr" / "page.png.md").read_text()


# -- row 9: run-batch lines of bounded length, a window bounded in bytes ------------------------
def test_a_too_long_line_is_an_error_line_and_the_job_goes_on(keyed_server,
                                                              tmp_path: Path) -> None:
    at_limit = line("at-limit")
    at_limit += " " * (2000 - len(at_limit))  # exactly --max-line-bytes: read
    lines = [line("a"), line("long", "x" * 3000), line("b"), at_limit, "  ", line("c")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines))  # (the last line without its newline)
    r = cli("run-batch", "-i", str(src), "-o", str(out), "--server", keyed_server.base,
            "--api-key", KEYS["alice"], "--max-line-bytes", "2000", "--per-line-errors")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = results(out)
    assert [x["custom_id"] for x in rows] == ["a", None, "b", "at-limit", "c"]
    assert rows[1]["response"] is None
    assert rows[1]["error"]["message"] == \
        f"line 2: {len(lines[1]) + 1} bytes, longer than --max-line-bytes (2000)"
    assert all(x["response"]["status_code"] == 200 for i, x in enumerate(rows) if i != 1)


def test_read_line_counts_a_line_without_its_newline_across_chunks() -> None:
    from triptych.jobs.run_batch import read_line

    f = io.BytesIO(b"abcdef\n" + b"x" * 25 + b"\n\n1234567\n123456" + b"\r\n1234567")
    got = []
    while (x := read_line(f, 6, chunk_size=4)) is not None:
        got.append(x)
    assert got == [(b"abcdef\n", 7), (None, 26), (b"\n", 1), (None, 8), (None, 8),
                   (None, 7)]


MAXRSS = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(rc)
"""


def test_lines_over_the_limit_are_never_held_whole(keyed_server, tmp_path: Path) -> None:
    def peak_rss(name: str, lines: list[str], *flags: str) -> tuple[int, list[dict]]:
        src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-out.jsonl"
        with open(src, "w") as f:
            for x in lines:
                f.write(x + "\n")
        r = subprocess.run([sys.executable, "-c", MAXRSS, sys.executable, "-m", "triptych",
                            "run-batch", "--no-progress", "-i", str(src), "-o", str(out),
                            "--server", keyed_server.base, "--api-key", KEYS["alice"],
                            "--per-line-errors", *flags],
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-3000:]
        return int(r.stdout), results(out)

    small = [line("a"), line("b")]
    big = line("big", "x" * (70 << 20))  # over the default --max-line-bytes (64 MiB)
    base, _ = peak_rss("small", small)
    peak, rows = peak_rss("big", [small[0], big, big, small[1]])
    assert [x["custom_id"] for x in rows] == ["a", None, None, "b"]
    assert "longer than --max-line-bytes (67108864)" in rows[1]["error"]["message"]
    # What reading a line may cost is bounded by the limit, not by the line: its first
    # --max-line-bytes are held until it is known to be too long (+120 MB here over the
    # small file, allocator slack included; the code before this held the parsed lines:
    # +430 MB for these two, 1.5 GB for two 100 MB lines).
    assert peak < base + 3 * (64 << 20), (base, peak)
    peak, rows = peak_rss("big", [small[0], big, big, small[1]], "--max-line-bytes", "1000000")
    assert [x["custom_id"] for x in rows] == ["a", None, None, "b"]
    assert peak < base + (16 << 20), (base, peak)


def test_ordered_map_holds_a_bounded_number_of_bytes() -> None:
    sizes = [10, 40, 5, 500, 30, 30, 30, 30, 1, 1, 1, 1, 60, 60, 60, 60]
    state = {"held": 0, "peak": 0}

    async def source():
        for i, n in enumerate(sizes):
            state["held"] += n
            state["peak"] = max(state["peak"], state["held"])
            yield i

    async def work(i: int) -> int:
        await asyncio.sleep(0.001 * ((i * 7) % 5))  # finish out of order
        return i

    async def main() -> list[int]:
        out = []
        async for i, _ in ordered_map(source(), work, concurrency=8, window=100,
                                      size=lambda i: sizes[i], max_bytes=100):
            state["held"] -= sizes[i]
            out.append(i)
        return out

    assert asyncio.run(main()) == list(range(len(sizes)))  # the 500-byte item too
    assert state["peak"] < 100 + 500, state


def test_help_names_the_new_flags_and_their_defaults() -> None:
    from triptych.jobs.backend import _serve_defaults
    from triptych.jobs.run_batch import DEFAULT_MAX_LINE_BYTES

    assert DEFAULT_MAX_LINE_BYTES == _serve_defaults().max_request_bytes
    env = {**os.environ, "COLUMNS": "200"}
    for command, texts in (("run-batch", ("--max-line-bytes", "(default: 67108864)",
                                          "--api-key", "OPENAI_API_KEY")),
                           ("ocr", ("--max-page-pixels", "(default: 32000000)", "--api-key"))):
        r = subprocess.run([sys.executable, "-m", "triptych", command, "--help"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0
        for text in texts:
            assert text in r.stdout, (command, text)
