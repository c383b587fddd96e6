"""Shared-memory segments for the shm transport: plain files in /dev/shm (tmpfs).

    <prefix><owner pid>-<pid namespace>-<endpoint id>-<token>
    e.g. triptych-4242-4026531836-9f3a01bc-5be0...(16 hex)

The token is random per segment (secrets): another local user cannot guess the next name
and pre-create it to make transfers fail. The pid namespace (its inode) keeps a server in
a sibling container sharing /dev/shm from judging our segments by a pid that means nothing
in its namespace (and us from judging its).

The sender writes a message's tensors once with pwrite (a full /dev/shm is a clean
ENOSPC, never a SIGBUS) into a fresh owner-only (0600) file. The receiver opens it,
unlinks it at once (it now owns the bytes), checks it (regular file, this user's, the
announced size, every tensor range inside) and maps it: the tensors it returns are views
of that mapping (no copy; the receiver may write to them, nobody else holds the file), and
the memory goes back to the system when the last of them is freed. No
multiprocessing.shared_memory, so no resource tracker to fight.

Ownership: a segment nobody took within the sender's TTL is unlinked by the sender; a
dead owner's leftovers (and its ipc socket directory) are removed by ``cleanup_stale``,
which the supervisor runs.

NOTE: a mapped file that shrinks raises SIGBUS on access. Once the receiver has unlinked
a segment only a process that already held it open could shrink it; the sender closes
its descriptor before sending the handle, so that takes another process of this same
user, which could harm us in many other ways anyway.
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import stat
import tempfile

import numpy as np
import torch

from .envelope import BadMessage, ConnectorError, TensorSpec
from .owner import owner_alive

SHM_DIR = "/dev/shm"
ALIGN = 64  # every tensor starts on a cache line
_PREFIX = re.compile(r"^[A-Za-z0-9_-]{1,48}-$")
_CHUNK = 1 << 30  # one pwrite call at most (Linux caps a call near 2 GiB)


def check_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise ConnectorError(f"bad segment prefix {prefix!r} (letters, digits, _ and -, "
                             "ending in -)")
    return prefix


def name_pattern(prefix: str) -> re.Pattern[str]:
    """Our segments' names: (owner pid, pid namespace, endpoint id, token)."""
    return re.compile(rf"^{re.escape(prefix)}(\d{{1,10}})-(\d{{1,20}})-([0-9a-f]{{8}})-"
                      rf"([0-9a-f]{{16}})$")


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 if unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def layout(specs_nbytes: list[int]) -> tuple[list[int], int]:
    """Aligned offset of each tensor and the segment size."""
    offsets, end = [], 0
    for n in specs_nbytes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


def write_segment(path: str, parts: list[np.ndarray], offsets: list[int], size: int) -> None:
    """Create ``path`` (must not exist) holding each byte array at its offset."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        for arr, off in zip(parts, offsets):
            view = memoryview(arr).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:done + _CHUNK], off + done)
        os.ftruncate(fd, size)  # the aligned tail
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)


def map_segment(path: str, size: int, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """Open, unlink (we own it now), check, and map the segment; return each tensor's
    bytes as a flat uint8 view of the mapping."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadMessage("shared-memory segment is gone (sender reaped it or died)") from None
    except OSError as e:
        raise BadMessage(f"cannot open shared-memory segment ({e.strerror})") from None
    try:
        unlink(path)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise BadMessage("shared-memory segment is not a regular file of this user")
        if st.st_size != size:
            raise BadMessage("shared-memory segment size does not match its handle")
        for s in specs:
            if s.offset > size or s.nbytes > size - s.offset:
                raise BadMessage("tensor range lies outside the shared-memory segment")
        if not size:
            return [torch.empty(0, dtype=torch.uint8) for _ in specs]
        # NOTE: shared, not copy-on-write: populating a private writable mapping copies
        # every page up front. The file is unlinked and the sender closed it, so the pages
        # are ours alone. Pre-faulted in one call: one fault per page costs more on a VM.
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # Each view keeps the mapping alive; it is unmapped when the last one is freed.
    return [torch.frombuffer(m, dtype=torch.uint8, count=s.nbytes, offset=s.offset)
            if s.nbytes else torch.empty(0, dtype=torch.uint8) for s in specs]


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:  # a zombie (dead, not yet reaped by its parent) is dead for our purpose
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def cleanup_stale(prefix: str = "triptych-", shm_dir: str = SHM_DIR,
                  tmp_dir: str | None = None) -> list[str]:
    """Remove this user's segments in ``shm_dir`` whose owner pid (the number after
    ``prefix``) is no longer alive, and ipc socket directories in ``tmp_dir`` whose owner
    no longer holds their lock (connector/owner.py). Returns
    the removed paths. Safe to run while live endpoints use the same prefix. In /dev/shm
    only names of our own form from our own pid namespace are judged: another container's
    segments, and other kinds of files (P0's processor-cache ring has its own cleanup), are
    never touched."""
    owner = re.compile(rf"^{re.escape(check_prefix(prefix))}(\d{{1,10}})-(ipc-)?")
    ours, ns = name_pattern(prefix), pid_namespace()
    removed = []
    for folder, want_dir in ((shm_dir, False), (tmp_dir or tempfile.gettempdir(), True)):
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for e in entries:
            m = owner.match(e.name)
            # Any file of a dead owner in /dev/shm is garbage; in /tmp only our socket
            # directories (<prefix><pid>-ipc-*) are ours to judge.
            if not m or (want_dir and not m.group(2)):
                continue
            if not want_dir:
                seg = ours.match(e.name)
                if seg is None or int(seg.group(2)) != ns:
                    continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if st.st_uid != os.getuid() or is_dir != want_dir:
                continue
            # NOTE: a dir by its owner's lock (connector/owner.py): a recycled pid or one
            # from another pid namespace sharing /tmp judges nothing; a segment by its pid
            # (its name holds our namespace; a recycled pid only delays its removal).
            pid = int(m.group(1))
            if owner_alive(e.path, pid, pid_alive) if is_dir else pid_alive(pid):
                continue
            if is_dir:
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                unlink(e.path)
            removed.append(e.path)
    return removed
