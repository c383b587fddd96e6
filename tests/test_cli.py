"""The command line as a new user meets it: each default shown once in --help, vLLM's flag
spellings, --model checked in one line before anything starts (offline: no download is
ever tried here), and `triptych chat` keeping log lines out of its answers."""
from __future__ import annotations

import http.server
import os
import re
import signal
import shutil
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import img, png

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def help_blocks(text: str) -> dict[str, str]:
    """option strings -> their help text (argparse wraps it over several lines)."""
    blocks: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("  -"):
            key = line.split("  ")[1].strip() if "  " in line.strip() else line.strip()
            blocks[key] = " ".join(line.split())
        elif key and line.startswith("    "):
            blocks[key] += " " + " ".join(line.split())
        else:
            key = None
    return blocks


def run_help(capsys, *argv: str) -> dict[str, str]:
    from triptych.cli import main
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return help_blocks(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [("serve",), ("chat",), ("make-tiny",),
                                  ("bench", "throughput"), ("bench", "serve")])
def test_help_shows_each_default_once(capsys, argv):
    blocks = run_help(capsys, *argv)
    assert blocks
    for opt, text in blocks.items():
        assert text.count("(default") <= 1, (opt, text)
    if argv == ("make-tiny",):
        (out,) = [t for o, t in blocks.items() if o.startswith("--out")]
        assert "default" not in out  # required: no default to show
    if argv == ("serve",):
        shown = {o.split()[0].rstrip(","): t for o, t in blocks.items()}
        for flag, default in (("--port", "8000"), ("--max-n", "16"), ("--block-size", "16"),
                              ("--max-pending-requests", "256"), ("--video-fps", "2.0"),
                              ("--max-video-pixels", "128000000"), ("--seed", "0"),
                              ("--media-fetch-timeout", "10.0")):
            assert f"(default: {default})" in shown[flag], shown[flag]
        assert "min(checkpoint max, 8192)" in shown["--max-model-len"]
        assert any(o.startswith("--num-gpu-blocks-override") and "--num-kv-blocks" in o
                   for o in blocks)
        assert any(o.startswith("--allowed-media-domains") and "--allowed-domains" in o
                   for o in blocks)
    if argv == ("chat",):
        assert "demo checkpoint" in " ".join(blocks.values())


def test_vllm_spellings_and_aliases():
    from triptych.api import serve_cmd
    from triptych.cli import ArgumentParser
    from triptych.config import EngineConfig

    p = ArgumentParser(prog="t")
    serve_cmd.add_parser(p.add_subparsers(dest="cmd", parser_class=ArgumentParser))
    for argv, want in ((["--num-gpu-blocks-override", "6"], 6), (["--num-kv-blocks", "5"], 5)):
        assert p.parse_args(["serve", *argv]).num_kv_blocks == want
    for flag in ("--allowed-media-domains", "--allowed-domains"):
        assert p.parse_args(["serve", flag, "a.example"]).allowed_media_domains == "a.example"
    assert p.parse_args(["serve", "--kv-cache-memory-bytes", "2GiB"]).kv_cache_memory == "2GiB"
    assert EngineConfig.from_kwargs(model="m", num_gpu_blocks_override=7).num_kv_blocks == 7
    with pytest.raises(TypeError):
        EngineConfig.from_kwargs(model="m", num_gpu_blocks_override=7, num_kv_blocks=7)


def one_line_error(*argv: str, env: dict | None = None, logs: bool = False) -> str:
    """The one error line (``logs``: after INFO lines such as "downloading ...")."""
    r = subprocess.run([sys.executable, "-m", "triptych", *argv], capture_output=True,
                       text=True, timeout=60, env=env or ENV, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    if logs:
        assert all(" INFO " in line for line in lines[:-1]), r.stderr
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("triptych: error:"), r.stderr
    return lines[0]


def test_model_is_checked_before_anything_starts(tmp_path):
    assert "no such directory" in one_line_error("serve", "--model", str(tmp_path / "nope"))
    assert "no config.json" in one_line_error("serve", "--model", str(tmp_path))
    (tmp_path / "f").write_text("x")
    assert "is a file" in one_line_error("chat", "--model", str(tmp_path / "f"))
    env = {**ENV, "HF_HOME": str(tmp_path / "hf")}
    line = one_line_error("serve", "--model", "Qwen/Qwen2-VL-2B-Instruct", env=env)
    assert "HF_HUB_OFFLINE" in line and "hf download Qwen/Qwen2-VL-2B-Instruct" in line
    assert "port" not in one_line_error("serve", "--model", str(tmp_path), "--max-n", "0")


def test_hub_id_found_in_the_cache_needs_no_network(tmp_path):
    snap = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    code = "from triptych.cli import resolve_model; print(resolve_model('org/tiny'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**ENV, "HF_HOME": str(tmp_path / "hf")}, check=False)
    assert r.returncode == 0 and r.stdout.strip() == str(snap), r.stderr


@pytest.fixture
def fake_hub():
    """A local stand-in for the Hugging Face hub that answers every request the way the
    real one answers for a repository that does not exist (404, X-Error-Code: RepoNotFound)."""
    class NoSuchRepo(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoSuchRepo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: connections are refused


def test_unreachable_hub_is_not_a_missing_model(tmp_path):
    # Network or not, a hub at a closed local port cannot be reached: huggingface_hub
    # raises LocalEntryNotFoundError from the connection error.
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    line = one_line_error("serve", "--model", "Qwen/Qwen2-VL-2B-Instruct", env=env, logs=True)
    assert "hub cannot be reached" in line and "no such model" not in line, line
    assert "hf download Qwen/Qwen2-VL-2B-Instruct" in line


def test_missing_model_on_a_reachable_hub(tmp_path, fake_hub):
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=fake_hub)
    line = one_line_error("serve", "--model", "nobody/no-such-model", env=env, logs=True)
    assert "hub has no such model" in line and "cannot be reached" not in line, line


def test_hub_errors_are_classified_by_what_the_hub_said():
    import httpx2
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    from triptych.cli import hub_says_no_such_model

    def answered(cls: type, status: int) -> Exception:
        req = httpx2.Request("GET", "https://huggingface.co/api/models/a/b")
        return cls("hub said so", response=httpx2.Response(status, request=req))

    def raised_from(outer: Exception, inner: BaseException) -> Exception:
        try:
            try:
                raise inner
            except BaseException as e:
                raise outer from e
        except Exception as e:  # noqa: BLE001
            return e

    offline = raised_from(LocalEntryNotFoundError("cannot find the snapshot folder"),
                          httpx2.ConnectError("Name or service not known"))
    assert not hub_says_no_such_model(offline)
    assert not hub_says_no_such_model(LocalEntryNotFoundError("not in the cache"))
    assert not hub_says_no_such_model(TimeoutError("read timed out"))
    for cls, status in ((RepositoryNotFoundError, 404), (GatedRepoError, 403),
                        (RevisionNotFoundError, 404)):
        assert hub_says_no_such_model(answered(cls, status))
        assert hub_says_no_such_model(raised_from(RuntimeError("wrapped"),
                                                  answered(cls, status)))


def test_chat_keeps_logs_out_of_answers(tiny_qwen2_vl, tmp_path):
    (tmp_path / "a.png").write_bytes(png(img(1)))
    script = (f"/image {tmp_path}/a.png\nWhat is it?\n/image {tmp_path}/none.png\n/reset\n"
              "/exit\nnever read\n")
    r = subprocess.run([sys.executable, "-m", "triptych", "chat", "--model", tiny_qwen2_vl,
                        "--max-tokens", "3", "--block-size", "4", "--max-model-len", "256",
                        "--allowed-local-media-path", str(tmp_path)],
                       input=script, capture_output=True, text=True, timeout=300, env=ENV,
                       cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert f"attached {tmp_path}/a.png" in out and "no such file" in out
    assert "assistant> " in out and "(new conversation)" in out
    assert out.count("assistant> ") == 1  # /exit quit: the line after it was never sent
    assert not re.search(r"INFO|WARNING|running \d+, waiting", out)
    assert not re.search(r"running \d+, waiting", r.stderr)  # no stats lines at all


class Chat:
    """`triptych chat` in a subprocess: lines in on stdin, stdout read as it comes.
    ``sigint_ignored``: started with SIGINT ignored, as a parent that ignores it leaves it
    (the chat must still stop and quit on Ctrl-C)."""

    def __init__(self, model: str, *flags: str, sigint_ignored: bool = False) -> None:
        import queue

        def ignore_sigint() -> None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "triptych", "chat", "--model", model, "--block-size", "4",
             *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=ENV, preexec_fn=ignore_sigint if sigint_ignored else None)
        self.out = ""
        self._chunks: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while chunk := self.proc.stdout.read(1):
            self._chunks.put(chunk)
        self._chunks.put("")

    def until(self, text: str, timeout: float = 120) -> None:
        """Read until ``text`` has appeared (a hang guard, not a speed claim)."""
        import queue
        start = len(self.out)
        while text not in self.out[start:]:
            try:
                chunk = self._chunks.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {text!r} in {self.out[-2000:]!r}") from None
            assert chunk, f"chat ended before {text!r}: {self.out[-2000:]!r}"
            self.out += chunk

    def wait_reading(self) -> None:
        """Until the chat blocks reading stdin. NOTE: input() prints its prompt before it
        reads; a SIGINT in between would wait for the next line (CPython checks signals
        between bytecodes), so a test that saw the prompt waits for the read itself."""
        from server_fixtures import wait_for
        wait_for(lambda: "pipe_read" in open(f"/proc/{self.proc.pid}/wchan").read(),
                 "the chat to wait for input")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a hang guard: say where the chat is stuck
            stacks = subprocess.run(["py-spy", "dump", "--pid", str(self.proc.pid)],
                                    capture_output=True, text=True, timeout=60).stdout \
                if shutil.which("py-spy") else "(no py-spy here)"
            self.proc.kill()
            raise AssertionError(f"the chat did not end: {self.out[-1500:]!r}\n{stacks}"
                                 f"\nstderr: {self.proc.stderr.read()[-3000:]}") from None
        finally:
            self.proc.kill()
        return code, self.proc.stderr.read()


def test_chat_commands_are_not_messages(tiny_qwen2_vl):
    chat = Chat(tiny_qwen2_vl, "--max-tokens", "2", "--max-model-len", "256")
    chat.until("you> ")
    chat.send("/help")
    chat.until("you> ")
    assert "/quit" in chat.out.split("you> ")[1]  # the help text, not an answer
    chat.send("/nonsense")
    chat.until("you> ")
    chat.send("/quit")
    code, err = chat.finish()
    assert code == 0 and "Traceback" not in err, err
    assert "assistant>" not in chat.out and "unknown command /nonsense" in chat.out


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["default", "inherited-ignore"])
def test_chat_ctrl_c_stops_an_answer_then_quits_at_the_prompt(tiny_qwen2_vl, sigint_ignored):
    # A long answer (the random model rarely ends by itself): Ctrl-C lands in the middle.
    # (inherited-ignore: once seen in the suite, where a test had left its xdist worker
    # ignoring SIGINT and the chat, its child, then ignored Ctrl-C at the prompt.)
    chat = Chat(tiny_qwen2_vl, "--max-tokens", "4000", "--max-model-len", "4096",
                sigint_ignored=sigint_ignored)
    chat.until("you> ")
    chat.send("Tell me a long story")
    chat.until("assistant> ")  # printed once Ctrl-C means "stop this answer"
    chat.proc.send_signal(signal.SIGINT)
    chat.until("(answer stopped)")
    chat.until("you> ")
    chat.send("/help")  # the conversation goes on
    chat.until("you> ")
    chat.wait_reading()
    chat.proc.send_signal(signal.SIGINT)  # at the prompt: quit
    code, err = chat.finish()
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
