"""Owned run dirs: a temp dir whose owner holds a lock on a file in it while it lives.

    <tmp>/triptych-<pid>-<...>/.owner    flock(LOCK_EX) held by the process that made it

A process that made a socket dir (the router's run dir, a worker's ipc endpoint dir, a TP
group's dir) keeps ``.owner`` open and locked until it removes the dir or dies; the kernel
drops the lock when the process ends, however it ends. Stale-dir cleanup asks the lock,
not the pid in the name: a pid that was recycled by an unrelated process does not make a
dead server's dir look alive, and a live server in another pid namespace sharing /tmp (a
sibling container) holds its lock, so it is never judged by a pid that means nothing here.
A dir without ``.owner`` (made by an older version, or caught between mkdtemp and the
lock) is judged by its pid, and only once it is older than YOUNG_S.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Callable

LOCK_NAME = ".owner"
YOUNG_S = 60.0  # a dir without a lock file this young may still be getting one


def make_owned_dir(prefix: str, dir: str | None = None) -> tuple[str, int]:
    """mkdtemp(prefix) (0700) with its lock taken; (path, lock fd: keep it open while the
    dir is in use, ``release`` it when done)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    fd = os.open(os.path.join(path, LOCK_NAME),
                 os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
    return path, fd


def release(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def owner_alive(path: str, pid: int, pid_alive: Callable[[int], bool]) -> bool:
    """Whether the process that made ``path`` may still use it (when unsure: True)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # no lock file: judged by its age and its pid
        try:
            young = time.time() - os.lstat(path).st_mtime < YOUNG_S
        except OSError:
            return False  # gone already
        return young or pid_alive(pid)
    except OSError:
        return True  # cannot be judged (a symlink, another user's): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # its owner holds the lock: alive, whatever its pid says
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
