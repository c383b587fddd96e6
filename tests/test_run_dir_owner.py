"""Stale-dir cleanup judges a run dir by the lock its owner holds while it lives
(connector/owner.py), not by the pid in its name (issue 15, point 7): a live owner whose pid
means nothing here (another pid namespace sharing /tmp) keeps its dir; a dir whose owner is
gone is removed even when its pid was recycled by a live, unrelated process. Both cleanups
(the router's run dirs, the connector's ipc dirs) follow it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from triptych.connector.owner import LOCK_NAME, make_owned_dir, release
from triptych.connector.segments import cleanup_stale
from triptych.router.supervisor import clean_stale

HOLD = ("import fcntl, os, sys\n"
        "fd = os.open(os.path.join(sys.argv[1], '.owner'), os.O_CREAT | os.O_RDWR, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n")  # holds the lock until its stdin closes


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def holder():
    procs = []

    def start(path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"  # (bounded: the child prints at once)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait(10)
        p.stdin.close()
        p.stdout.close()


@pytest.mark.parametrize("kind", ["run dir", "ipc dir"])
def test_the_owner_lock_decides_not_the_pid(tmp_path, holder, kind):
    clean = (lambda: [os.path.basename(p) for p in cleanup_stale(
        shm_dir=str(tmp_path / "no-shm"), tmp_dir=str(tmp_path))]) if kind == "ipc dir" \
        else (lambda: clean_stale(str(tmp_path)))
    mid = "ipc-" if kind == "ipc dir" else ""
    dead = _dead_pid()
    # a live server in another pid namespace: its pid is dead here, it holds its lock
    other_ns = tmp_path / f"triptych-{dead}-{mid}otherns"
    other_ns.mkdir()
    owner = holder(other_ns)
    # a dead server whose pid was recycled by a live, unrelated process (this one)
    recycled = tmp_path / f"triptych-{os.getpid()}-{mid}recycled"
    recycled.mkdir()
    (recycled / LOCK_NAME).touch()  # its lock file, held by nobody
    assert clean() == [recycled.name]
    assert other_ns.exists() and not recycled.exists()
    owner.kill()  # the other server ends: its lock goes with it
    owner.wait(10)
    assert clean() == [other_ns.name]


def test_our_own_dirs_are_locked_while_we_hold_them(tmp_path):
    path, fd = make_owned_dir("triptych-1-", str(tmp_path))  # pid 1: alive, not us
    assert os.path.exists(os.path.join(path, LOCK_NAME))
    assert clean_stale(str(tmp_path)) == []
    release(fd)
    assert clean_stale(str(tmp_path)) == [os.path.basename(path)]


def test_a_dir_without_a_lock_is_judged_by_pid_once_old(tmp_path):
    young = tmp_path / f"triptych-{_dead_pid()}-young"  # between mkdtemp and its lock
    young.mkdir()
    old = tmp_path / f"triptych-{_dead_pid()}-old"
    old.mkdir()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert clean_stale(str(tmp_path)) == [old.name]
