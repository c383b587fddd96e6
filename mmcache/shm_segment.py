"""Named shared-memory segments in /dev/shm: created owner-only, found again after a crash.

No ``multiprocessing.shared_memory`` (its resource tracker unlinks segments behind our back
or warns about "leaks" in reader processes): a segment is a plain file in /dev/shm opened
with ``os.open`` and mapped with ``mmap``.

Name: ``triptych-<pid>-<start>-<ns>-<random>``; ``pid`` and ``start`` (its start time in
clock ticks since boot, /proc/<pid>/stat field 22) identify the creating process even
after its pid is reused, ``ns`` is the inode of its pid namespace, so a process never
judges segments of another container sharing /dev/shm. A segment whose creator no longer
runs is stale: ``cleanup_stale_segments()`` (called when a writer starts) removes it, so
nothing outlives a P0 killed with -9 past the next start.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat

SHM_DIR = "/dev/shm"
PREFIX = "triptych-"
_NAME_RE = re.compile(r"^triptych-(\d+)-(\d+)-(\d+)-[0-9a-f]{16}$")


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if it does not run (a zombie,
    killed but not yet reaped, does not run)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2:].split()
    if fields[0] == b"Z":
        return None
    return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def new_segment_name() -> str:
    pid = os.getpid()
    return f"{PREFIX}{pid}-{_start_time(pid)}-{_pid_namespace()}-{secrets.token_hex(8)}"


def check_segment_name(name: str) -> None:
    # NOTE: names arrive in messages; only our own pattern (no '/', no '..') is opened.
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError("not a triptych shared-memory segment name")


def create_segment(size: int, shm_dir: str = SHM_DIR) -> tuple[str, mmap.mmap]:
    """A new zero-filled segment of ``size`` bytes, mode 0600, fully backed by memory."""
    name = new_segment_name()
    path = os.path.join(shm_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask was
        try:
            # NOTE: reserve every page now: a write to a sparse tmpfs page that cannot be
            # backed later raises SIGBUS and kills the writer instead of an error here.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise RuntimeError(f"cannot reserve {size} bytes in {shm_dir} ({e.strerror}); "
                               "lower mm_processor_cache_gb or enlarge /dev/shm") from None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        unlink_segment(name, shm_dir)
        raise
    os.close(fd)
    return name, mm


def open_segment(name: str, shm_dir: str = SHM_DIR) -> mmap.mmap:
    """Map an existing segment read-only after checking it is ours and private."""
    check_segment_name(name)
    fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError("shared-memory segment is not a private file of this user")
        if st.st_size == 0:
            raise ValueError("shared-memory segment is empty")
        return mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def adopt_segment(name: str, shm_dir: str = SHM_DIR) -> str:
    """Take over another process's segment: renamed under this process's name, so it lives
    as long as this process does (a stale-segment sweep judges it by its name's creator).
    The new name; ValueError for a name that is not a private segment of this user."""
    check_segment_name(name)
    old = os.path.join(shm_dir, name)
    st = os.lstat(old)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError("shared-memory segment is not a private file of this user")
    new = new_segment_name()
    os.rename(old, os.path.join(shm_dir, new))
    return new


def unlink_segment(name: str, shm_dir: str = SHM_DIR) -> None:
    try:
        os.unlink(os.path.join(shm_dir, name))
    except FileNotFoundError:
        pass


def list_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names of every triptych segment in ``shm_dir`` (any process)."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if _NAME_RE.match(n))
    except FileNotFoundError:
        return []


def segments_of(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Names of the segments process ``pid`` (of this pid namespace) created."""
    ns = _pid_namespace()
    return [n for n in list_segments(shm_dir)
            if (m := _NAME_RE.match(n)) and int(m[1]) == pid and int(m[3]) == ns]


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose creating process (same pid namespace) is gone;
    the names removed."""
    removed = []
    ns, uid = _pid_namespace(), os.getuid()
    for name in list_segments(shm_dir):
        m = _NAME_RE.match(name)
        assert m is not None
        pid, start, seg_ns = int(m[1]), int(m[2]), int(m[3])
        if seg_ns != ns or _start_time(pid) == start:
            continue  # another container's, or its creator still runs
        try:
            st = os.lstat(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue
        if st.st_uid == uid and stat.S_ISREG(st.st_mode):
            unlink_segment(name, shm_dir)
            removed.append(name)
    return removed
