"""`triptych chat` driven by a script: `/quit` ends the chat when its line arrives, whatever
stdin is (a pipe, a terminal, a socket), with the writer still holding its end open, as in
`(printf '/quit\\n'; sleep 120) | triptych chat`. Nothing here closes the chat's stdin
before it has exited, so a chat that waited for end of input would hang into the guard."""
from __future__ import annotations

import os
import pty
import socket
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import wait_for

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
HANG_GUARD_S = 180  # the model loads first; a guard against a hang, not a speed claim


class StdinOf:
    """One kind of stdin for the chat: ``child`` goes to the chat, ``write`` feeds it, and
    the writer's end stays open until ``close``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "pipe":
            r, w = os.pipe()
            self.child, self._write = r, lambda b: os.write(w, b)
            self._ends = [r, w]
        elif kind == "terminal":
            master, slave = pty.openpty()
            self.child, self._write = slave, lambda b: os.write(master, b)
            self._ends = [master, slave]
        else:
            a, b = socket.socketpair()
            self.child, self._write = b.fileno(), a.sendall
            self._ends = [a, b]

    def write(self, text: str) -> None:
        self._write(text.encode())

    def close(self) -> None:
        for end in self._ends:
            end.close() if isinstance(end, socket.socket) else os.close(end)


def start_chat(model: str, stdin: StdinOf) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "triptych", "chat", "--model", model, "--block-size", "4",
         "--max-model-len", "256", "--max-tokens", "2"],
        stdin=stdin.child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=ENV)


def finish(proc: subprocess.Popen, stdin: StdinOf) -> tuple[int, str, str]:
    """The chat's exit, with its stdin still open at our end; the guard reports a hang."""
    try:
        code = proc.wait(timeout=HANG_GUARD_S)
        assert code is not None
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"chat on a {stdin.kind} did not quit at /quit: {out[-1500:]!r}"
                             f"\n{err[-2000:]}") from None
    finally:
        stdin.close()
    out, err = proc.communicate(timeout=60)
    return code, out, err


@pytest.mark.parametrize("kind", ["pipe", "terminal", "socket"])
def test_quit_sent_before_the_prompt_ends_the_chat(tiny_qwen2_vl, kind):
    """The script's lines are all there before the model has loaded; the line after /quit
    is never sent to the model."""
    stdin = StdinOf(kind)
    proc = start_chat(tiny_qwen2_vl, stdin)
    stdin.write("/help\n/quit\nTell me a story\n")
    code, out, err = finish(proc, stdin)
    assert code == 0, err[-2000:]
    assert out.count("you> ") == 2 and "assistant>" not in out, out
    assert "Traceback" not in err, err[-2000:]


def test_quit_at_the_prompt_ends_the_chat_on_a_pipe(tiny_qwen2_vl):
    """The chat is reading its pipe (blocked in read) when /quit arrives."""
    stdin = StdinOf("pipe")
    proc = start_chat(tiny_qwen2_vl, stdin)
    try:
        def reading() -> bool:
            assert proc.poll() is None, f"the chat ended early: {proc.stderr.read()[-2000:]}"
            return "pipe_read" in open(f"/proc/{proc.pid}/wchan").read()
        wait_for(reading, "the chat to wait for input", timeout=HANG_GUARD_S)
    except BaseException:
        proc.kill()
        stdin.close()
        raise
    stdin.write("/quit\n")
    code, out, err = finish(proc, stdin)
    assert code == 0 and out.count("you> ") == 1, (out, err[-2000:])
