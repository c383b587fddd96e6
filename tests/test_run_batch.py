"""`triptych run-batch`: OpenAI batch files through serve's own app, in-process or --server.

The tiny checkpoint has random weights: outputs are gibberish, so the tests compare paths
with each other (greedy, temperature 0), and check counts, order, shapes and error objects.
"""
from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from triptych.jobs.driver import ordered_map
from triptych.jobs.ledger import Ledger, key_of, recover
from triptych.jobs.run_batch import parse_line

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import _children, alive, data_url, img, module_server, png  # noqa: E402

TIMEOUT = 300  # seconds any one CLI run may take here


def chat_line(cid: str, text: str, image: bool = False, **kw: object) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(png(img(3)))}})
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4,
                     "temperature": 0, **kw}}


def completion_line(cid: str, prompt: str, **kw: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}}


MIXED = [
    json.dumps(chat_line("chat-image", "what is this?", image=True)),
    json.dumps(completion_line("completion", "hello there")),
    '{"custom_id": "broken", "method": "POST", ',  # malformed JSON
    json.dumps(completion_line("bad-param", "x", temperature=-1)),  # the server refuses
    json.dumps(completion_line("completion", "a second line with the same id")),
    json.dumps({**completion_line("wrong-url", "x"), "url": "/v1/embeddings"}),
    json.dumps(chat_line("chat-text", "tell me", model=None)),
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triptych", "run-batch", "--no-progress",
                           *args], input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT)


def read_results(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def comparable(result: dict) -> object:
    """What two runs of a greedy line must agree on (ids, timestamps and prefix-cache hits,
    which depend on what ran before, differ)."""
    if result["error"] is not None:
        return result["custom_id"], result["error"]
    body, usage = result["response"]["body"], result["response"]["body"]["usage"]
    return result["custom_id"], body["choices"], usage["prompt_tokens"], \
        usage["completion_tokens"], usage["prompt_tokens_details"]["multimodal_tokens"]


@pytest.fixture(scope="module")
def in_process(tiny_qwen2_vl: str, tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("batch")
    out = d / "out.jsonl"
    r = run_cli("-i", str(write_lines(d / "in.jsonl", MIXED)), "-o", str(out),
                "--model", tiny_qwen2_vl, "--max-concurrency", "3", "--per-line-errors")
    assert r.returncode == 0, r.stderr[-3000:]
    return read_results(out)


def test_one_result_per_line_in_order_with_errors_on_bad_lines(in_process: list[dict]) -> None:
    assert [r["custom_id"] for r in in_process] == [
        "chat-image", "completion", None, "bad-param", "completion", "wrong-url", "chat-text"]
    for r in in_process:
        assert set(r) == {"id", "custom_id", "response", "error"}
        assert r["id"].startswith("batch_req_")
    ok = {0, 1, 6}
    for i in ok:
        resp = in_process[i]["response"]
        assert in_process[i]["error"] is None and resp["status_code"] == 200
        assert resp["request_id"] and resp["body"]["model"] == "qwen2_vl"  # served model
        assert resp["body"]["usage"]["completion_tokens"] == 4
    assert in_process[0]["response"]["body"]["object"] == "chat.completion"
    assert in_process[0]["response"]["body"]["usage"]["prompt_tokens_details"][
        "multimodal_tokens"]["image"] > 0
    assert in_process[1]["response"]["body"]["object"] == "text_completion"
    errors = {i: in_process[i]["error"] for i in range(len(in_process)) if i not in ok}
    for e in errors.values():
        assert set(e) == {"message", "type", "param", "code"}
    assert in_process[2]["response"] is None and "not valid JSON" in errors[2]["message"]
    # refused by the server: its status and its error object (naming the field)
    assert in_process[3]["response"]["status_code"] == 400
    assert in_process[3]["response"]["body"] is None
    assert errors[3]["param"] == "temperature"
    assert in_process[4]["response"] is None and errors[4]["param"] == "custom_id"
    assert "line 2" in errors[4]["message"]
    assert in_process[5]["response"] is None and errors[5]["param"] == "url"


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl: str, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory)


def test_server_mode_answers_as_in_process_through_stdin_and_stdout(
        in_process: list[dict], server) -> None:
    r = run_cli("-i", "-", "-o", "-", "--server", server.base, "--per-line-errors",
                stdin="\n".join(MIXED) + "\n")
    assert r.returncode == 0, r.stderr[-3000:]
    remote = [json.loads(x) for x in r.stdout.splitlines()]
    assert [comparable(x) for x in remote] == [comparable(x) for x in in_process]


@pytest.mark.parametrize("bad", ['{"method": "POST", "url": "/v1/completions", "body": {}}',
                                 "not json", '{"custom_id": "x", "url": 5, "body": {}}'])
def test_a_line_that_is_no_request_stops_the_run_before_anything_is_written(
        bad: str, tmp_path: Path) -> None:
    """vLLM's run-batch: the whole file is checked first; a bad line (here the third) is a
    non-zero exit naming it, and the output file is not created. (No engine starts: the
    check comes before it.)"""
    lines = [json.dumps(completion_line("a", "x")), json.dumps(completion_line("b", "y")),
             bad]
    out = tmp_path / "out.jsonl"
    r = run_cli("-i", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out),
                "--model", "/nonexistent-model-never-loaded")
    assert r.returncode == 1
    assert "line 3" in r.stderr and "--per-line-errors" in r.stderr
    assert not out.exists()
    r = run_cli("-i", "-", "-o", str(out), "--model", "/nonexistent-model-never-loaded",
                stdin="\n".join(lines) + "\n")  # standard input: checked all the same
    assert r.returncode == 1 and "line 3" in r.stderr and not out.exists()


def test_layout_flags_reach_the_engine_and_answer_alike(in_process: list[dict],
                                                         tiny_qwen2_vl: str, tmp_path: Path
                                                         ) -> None:
    out = tmp_path / "out.jsonl"
    r = run_cli("-i", str(write_lines(tmp_path / "in.jsonl", MIXED)), "-o", str(out),
                "--model", tiny_qwen2_vl, "--encode-workers", "1", "--prefill-workers", "1",
                "--decode-workers", "1", "--per-line-errors")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "router listening (1e1p1d)" in r.stderr  # an E+P+D layout ran it
    assert [comparable(x) for x in read_results(out)] == [comparable(x) for x in in_process]


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = TIMEOUT
                    ) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count("\n") >= n):
        assert proc.poll() is None, "run-batch ended before it was interrupted"
        assert time.monotonic() < deadline, "no output lines in time"
        time.sleep(0.05)


def _run_dirs(*pids: int) -> list[str]:
    """The run / socket directories these processes made (other sessions' are not ours)."""
    return [p for pid in pids for p in glob.glob(os.path.join(tempfile.gettempdir(),
                                                              f"triptych-{pid}-*"))]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_interrupted_run_resumes_with_each_custom_id_once(tiny_qwen2_vl: str, tmp_path: Path,
                                                          sig: int) -> None:
    ids = [f"req-{i}" for i in range(30)]  # (enough that the signal comes mid-run)
    lines = [json.dumps(completion_line(c, f"prompt number {i}", max_tokens=8,
                                        ignore_eos=True)) for i, c in enumerate(ids)]
    lines.insert(5, "not json at all")
    src, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "triptych", "run-batch", "--no-progress", "-i", str(src),
           "-o", str(out), "--model", tiny_qwen2_vl, "--max-concurrency", "1",
           "--per-line-errors"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_lines(out, 3, proc)
        workers = _children(proc.pid)
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    deadline = time.monotonic() + 30  # the engine's workers end with it (parent-death signal)
    while any(alive(p) for p in workers) or _run_dirs(proc.pid, *workers):
        assert time.monotonic() < deadline, "workers or run dirs outlived the interrupted run"
        time.sleep(0.1)
    first = read_results(out)
    assert 3 <= len(first) < len(lines)
    with open(out, "a") as f:  # as if the kill had cut a line short
        f.write('{"id": "batch_req_cut", "custom_id": "req-')
    r = run_cli("-i", str(src), "-o", str(out), "--model", tiny_qwen2_vl, "--resume",
                "--per-line-errors")
    assert r.returncode == 0, r.stderr[-3000:]
    results = read_results(out)
    assert [x["custom_id"] for x in results] == ids[:5] + [None] + ids[5:]
    assert results[:len(first)] == first  # kept, not rewritten
    assert all(x["error"] is None for x in results if x["custom_id"] is not None)


def test_ledger_counts_lines_and_cuts_a_half_written_tail(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "a"}\n'
                   '{"custom_id": null}\n{"custom_id": "c", "resp')
    done = recover(str(out), lambda d: key_of(d.get("custom_id")))
    assert out.read_text().endswith('{"custom_id": null}\n')
    ledger = Ledger(done)
    assert ledger.total == 4
    assert [ledger.skip(key_of(k)) for k in ("a", "a", "a", "b", "b", None, None, "c")] == \
        [True, True, False, True, False, True, False, False]


def test_line_checks() -> None:
    assert parse_line(1, "[1]").error["message"] == "line 1: a request line is a JSON object"
    assert parse_line(2, json.dumps({"custom_id": 5})).error["param"] == "custom_id"
    bad_method = {**completion_line("x", "y"), "method": "GET"}
    assert parse_line(3, json.dumps(bad_method)).error["param"] == "method"
    stream = completion_line("x", "y", stream=True)
    assert parse_line(4, json.dumps(stream)).error["param"] == "body.stream"
    ok = parse_line(5, json.dumps(completion_line("x", "y")))
    assert ok.error is None and ok.url == "/v1/completions" and ok.body["prompt"] == "y"


def test_ordered_map_keeps_order_and_bounds() -> None:
    state = {"running": 0, "peak": 0, "pulled": 0, "yielded": 0, "max_held": 0}

    async def source():
        for i in range(50):
            state["pulled"] += 1
            state["max_held"] = max(state["max_held"], state["pulled"] - state["yielded"])
            yield i

    async def work(i: int) -> int:
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        await asyncio.sleep(0.001 * ((i * 7) % 5))  # finish out of order
        state["running"] -= 1
        return i * i

    async def main() -> list[int]:
        out = []
        async for i, r in ordered_map(source(), work, concurrency=3, window=6):
            state["yielded"] += 1
            out.append((i, r))
        return out

    assert asyncio.run(main()) == [(i, i * i) for i in range(50)]
    assert state["peak"] <= 3 and state["max_held"] <= 7


def test_ordered_map_closes_its_source_when_stopped_early() -> None:
    closed = []

    async def source():
        try:
            for i in range(100):
                yield i
        finally:
            closed.append(True)

    async def work(i: int) -> int:
        await asyncio.sleep(0)
        return i

    async def main() -> None:
        gen = ordered_map(source(), work, concurrency=2)
        async for i, _ in gen:
            if i == 3:
                break
        await gen.aclose()
        assert closed == [True]  # at once, not when the loop finalizes it

    asyncio.run(main())


def test_help_names_every_flag_with_its_default() -> None:
    r = subprocess.run([sys.executable, "-m", "triptych", "run-batch", "--help"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for flag in ("--input-file", "--output-file", "--max-concurrency", "(default: 64)",
                 "--resume", "--server", "--request-timeout", "(default: 3600.0)",
                 "--decode-workers"):
        assert flag in r.stdout
