"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit runs."""
from __future__ import annotations

import os
import signal

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    """A tiny random Qwen2-VL checkpoint, made once per test session by make_tiny."""
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen2_vl", str(tmp_path_factory.mktemp("tiny") / "qwen2_vl"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen2_5_vl", str(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl"), seed=0)


def _our_files() -> set[str]:
    """triptych's socket/run directories in the temp dir and its shared-memory entries."""
    import glob
    import tempfile

    found = (set(glob.glob(os.path.join(tempfile.gettempdir(), "triptych-*")))
             | set(glob.glob("/dev/shm/triptych*")))
    return {f for f in found if not _someone_elses(f)}


def _someone_elses(path: str) -> bool:
    """An entry named triptych-<pid>-... of a live process outside this test session (an
    other checkout's tests on a shared machine); dead owners' entries are leaks and count."""
    import re

    m = re.match(r"triptych-(\d+)-", os.path.basename(path))
    if not m or int(m.group(1)) == os.getpid() or not os.path.exists(f"/proc/{m.group(1)}"):
        return False
    pid = int(m.group(1))
    while pid > 1:  # walk up to see whether this session started it
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == os.getpid():
            return False
    return True


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """The whole session leaves no socket directory, run directory or /dev/shm entry behind
    (set up first, so torn down last: after every server, pool and worker has stopped)."""
    import time

    before = _our_files()
    yield
    deadline = time.monotonic() + 10.0
    while (left := _our_files() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the test session left these behind: {sorted(left)}"


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """A test that changes SIGINT's handler in this process (a worker entry point run
    in-process ignores it) gets it put back: children inherit an ignored SIGINT, and Ray's
    nodes or a chat started later would then ignore Ctrl-C / their stop signal."""
    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before:
        signal.signal(signal.SIGINT, before)
