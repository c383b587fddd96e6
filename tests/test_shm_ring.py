"""The shm processor cache: a real /dev/shm ring, real reader and writer processes."""
from __future__ import annotations

import hashlib
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch

from triptych.mmcache.shm_ring import (ShmEntryOverwritten, ShmItemRef, ShmRingReader,
                                       ShmRingWriter)
from triptych.mmcache.shm_segment import (SHM_DIR, cleanup_stale_segments, list_segments,
                                          unlink_segment)

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
WORKER = os.path.join(os.path.dirname(__file__), "shm_worker.py")
HDR = 128  # entry header bytes (mmcache/shm_ring.py)
_pids = {os.getpid()}  # this test session and every process it starts


def segments_of_ours() -> list[str]:
    return [n for n in list_segments() if int(n.split("-")[1]) in _pids]


@pytest.fixture(autouse=True)
def nothing_left_in_dev_shm():
    yield
    assert segments_of_ours() == [], "a test left a segment in /dev/shm"


def spawn(*args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, WORKER, *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    _pids.add(p.pid)
    return p


class Lines:
    """A worker's stdout lines, read by a thread so that every wait has a timeout."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(p.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        try:
            for line in stream:
                self.q.put(line)
        except (ValueError, OSError):  # closed by the test
            pass
        self.q.put("")

    def next(self, timeout: float = 60.0) -> str:
        line = self.q.get(timeout=timeout)
        assert line, "worker exited"
        return line.strip()


def digest(x: torch.Tensor) -> str:  # as shm_worker.py reports a read
    return hashlib.blake2b(x.contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def t(n: int, fill: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + fill).to(dtype).view(-1, 2)


def entry(n: int, itemsize: int = 4) -> int:
    return (HDR + n * itemsize + 63) // 64 * 64  # ring bytes of one tensor of n elements


def test_put_get_read_in_place():
    w = ShmRingWriter(1 << 16)
    r = ShmRingReader(w.name)
    try:
        st = os.stat(os.path.join(SHM_DIR, w.name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert w.name.startswith(f"triptych-{os.getpid()}-")
        items = {"f32": t(10, 1.0), "bf16": t(8, 2.0, torch.bfloat16),
                 "f16": t(6, 3.0, torch.float16)}
        refs = {k: w.put(k, v) for k, v in items.items()}
        for k, v in items.items():
            got = r.read(refs[k], k)
            assert got.dtype == v.dtype and torch.equal(got, v)
            assert w.get(k) == refs[k] and w.put(k, v) == refs[k]  # P0 holds the keys
        assert w.get("nope") is None and len(w) == 3
        w.check_integrity()
    finally:
        r.close()
        w.close()
    assert not os.path.exists(os.path.join(SHM_DIR, w.name))


def test_reader_validates_every_ref():
    w = ShmRingWriter(1 << 16)
    r = ShmRingReader(w.name)
    try:
        ref = w.put("a", t(10, 0.0))
        with pytest.raises(ShmEntryOverwritten):
            r.read(ref, "b")  # another key's digest
        for bad in (ShmItemRef(ref.offset, ref.seq, "float16", ref.shape),
                    ShmItemRef(ref.offset, ref.seq, ref.dtype, [10]),
                    ShmItemRef(ref.offset, ref.seq + 1, ref.dtype, ref.shape)):
            with pytest.raises(ShmEntryOverwritten):
                r.read(bad, "a")
        for bad in (ShmItemRef(ref.offset + 8, ref.seq, ref.dtype, ref.shape),  # misaligned
                    ShmItemRef(1 << 16, ref.seq, ref.dtype, ref.shape),  # outside
                    ShmItemRef(0, ref.seq, ref.dtype, [1 << 40]),  # huge
                    ShmItemRef(0, ref.seq, "int64", ref.shape),
                    ShmItemRef(0, ref.seq, ref.dtype, [-1, 2]),
                    ShmItemRef(0, 0, ref.dtype, ref.shape)):
            with pytest.raises(ValueError):
                r.read(bad, "a")
        with pytest.raises(ValueError):
            ShmRingReader("../../etc/passwd")
    finally:
        r.close()
        w.close()


def test_two_reader_processes_read_what_p0_wrote():
    w = ShmRingWriter(1 << 20)
    readers = []
    try:
        items = {f"k{i}": t(2000 + 2 * i, float(i)) for i in range(6)}
        refs = {k: w.put(k, v) for k, v in items.items()}
        enc = msgspec.json.Encoder()
        lines = "".join(enc.encode((k, refs[k])).decode() + "\n" for k in items)
        lines += enc.encode(("k0", refs["k1"])).decode() + "\n"  # a ref under the wrong key
        readers = [spawn("reader", w.name) for _ in range(2)]
        want = [digest(v) for v in items.values()] + ["gone"]
        for p in readers:
            out, _ = p.communicate(lines, timeout=120)
            assert out.split() == want and p.returncode == 0
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        w.close()


def test_wraparound_evicts_the_oldest_in_ring_order():
    n = 64  # 256 payload bytes -> 384-byte entries
    w = ShmRingWriter(4 * entry(n))
    r = ShmRingReader(w.name)
    try:
        refs = [w.put(f"k{i}", t(n, i)) for i in range(4)]
        assert [ref.offset for ref in refs] == [0, entry(n), 2 * entry(n), 3 * entry(n)]
        ref4 = w.put("k4", t(n, 4))
        assert ref4.offset == 0 and w.get("k0") is None  # the oldest went
        assert [w.get(f"k{i}") for i in range(1, 4)] == refs[1:]
        with pytest.raises(ShmEntryOverwritten):
            r.read(refs[0], "k0")
        assert torch.equal(r.read(refs[1], "k1"), t(n, 1))
        # A bigger entry runs over the two oldest (k1, k2) ...
        x = w.put("x", t(144, 9))  # 704-byte entry
        assert x.offset == entry(n) and w.get("k1") is None and w.get("k2") is None
        assert w.get("k3") == refs[3] and w.get("k4") == ref4
        # ... and one that does not fit before the end wraps: the tail it skips held the
        # oldest entry (k3), which goes too, though its bytes are not written over.
        y = w.put("y", t(200, 7))  # 960-byte entry
        assert y.offset == 0 and len(w) == 1 and w.get("k3") is None
        with pytest.raises(ShmEntryOverwritten):
            r.read(refs[3], "k3")
        assert torch.equal(r.read(y, "y"), t(200, 7)) and w.num_evicted == 6
        w.check_integrity()
    finally:
        r.close()
        w.close()


def test_oversize_item_goes_inline():
    w = ShmRingWriter(4096)
    try:
        assert w.put("huge", t(4096, 0.0)) is None and w.num_inline == 1 and len(w) == 0
        assert w.put("fits", t(64, 0.0)) is not None
    finally:
        w.close()


def test_pinned_entries_are_never_run_over(monkeypatch):
    # The ring's clock is the test's: a lease expires when the test says so, however
    # slowly a loaded box runs the lines in between.
    import types

    from triptych.mmcache import shm_ring
    now = [1000.0]
    monkeypatch.setattr(shm_ring, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    n = 64
    w = ShmRingWriter(3 * entry(n), pin_lease_s=0.5)
    r = ShmRingReader(w.name)
    try:
        ref0 = w.put("k0", t(n, 0), pin=True)
        w.put("k1", t(n, 1))
        w.put("k2", t(n, 2))
        assert w.put("k3", t(n, 3)) is None  # would overwrite pinned k0: sent inline instead
        assert torch.equal(r.read(ref0, "k0"), t(n, 0)) and w.num_inline == 1
        assert w.get("k1", pin=True) is not None
        w.unpin("k0")
        assert w.put("k3", t(n, 3)).offset == 0  # k0 unpinned: the head moves on
        assert w.put("k4", t(n, 4)) is None  # k1 is pinned now
        now[0] += 0.6  # every pin is a lease: an expired one no longer holds the ring
        assert w.put("k4", t(n, 4)) is not None and w.get("k1") is None
        w.check_integrity()
    finally:
        r.close()
        w.close()


class PausingReader(ShmRingReader):
    """Lets the writer run over the entry between the first header check and the copy's
    end, the window a seqlock must cover."""

    def __init__(self, name: str, during_copy) -> None:
        super().__init__(name)
        self.during_copy = during_copy

    def _copy(self, start: int, nbytes: int):
        self.during_copy()  # the header was checked; now the writer runs over the entry
        return super()._copy(start, nbytes)


def test_entry_overwritten_during_the_copy_is_detected():
    n = 64
    w = ShmRingWriter(2 * entry(n))
    try:
        ref = w.put("k0", t(n, 0))
        w.put("k1", t(n, 1))
        r = PausingReader(w.name, lambda: w.put("k2", t(n, 2)))  # runs k0 over mid-read
        with pytest.raises(ShmEntryOverwritten):
            r.read(ref, "k0")
        r.during_copy = lambda: None
        assert torch.equal(r.read(w.get("k2"), "k2"), t(n, 2))
        r.close()
    finally:
        w.close()


def test_a_churning_writer_process_never_yields_a_torn_read():
    n = 1 << 20  # 1 MiB entries: copies take long enough for the writer to overlap them
    p = spawn("churn", str(3 * entry(n, 1)), str(n))
    lines = Lines(p)
    good = gone = 0
    try:
        r = ShmRingReader(lines.next())
        dec = msgspec.json.Decoder(tuple[str, ShmItemRef])
        # At least 3 s of churn, and on until enough reads were seen however loaded the
        # box is (120 s: a hang guard).
        start = time.monotonic()
        while time.monotonic() - start < 3.0 or not (good > 0 and good + gone > 10):
            assert time.monotonic() - start < 120, (good, gone)
            key, ref = dec.decode(lines.next())
            try:
                data = r.read(ref, key).view(torch.uint8)
            except ShmEntryOverwritten:
                gone += 1
                continue
            fill = int(key[1:]) % 251
            assert bool((data == fill).all()), "a read returned bytes of another entry"
            good += 1
        r.close()
    finally:
        p.stdin.close()  # the writer stops; the pump thread drains its stdout to EOF
        p.wait(timeout=30)
        p.stdout.close()
    print(f"churn: {good} reads intact, {gone} detected as overwritten")
    assert good > 0 and good + gone > 10


def test_no_segment_remains_after_close_or_gc():
    w = ShmRingWriter(1 << 16)
    r = ShmRingReader(w.name)
    ref = w.put("a", t(8, 0))
    w.close()
    assert w.name not in list_segments()
    assert torch.equal(r.read(ref, "a"), t(8, 0))  # a mapped reader still works
    r.close()
    w2 = ShmRingWriter(1 << 16)
    name = w2.name
    del w2  # dropped without close(): the finalizer unlinks
    assert name not in list_segments()


def test_kill_9_then_a_new_writer_removes_the_stale_segment():
    p = spawn("writer", "65536")
    old = Lines(p).next()
    live = spawn("writer", "65536")
    live_name = Lines(live).next()
    try:
        assert {old, live_name} <= set(list_segments())
        p.send_signal(signal.SIGKILL)  # P0 dies without cleaning up
        # Dead but not reaped yet: a zombie counts as dead (waited for as an event).
        deadline = time.monotonic() + 60  # a hang guard
        while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed writer never became a zombie"
            time.sleep(0.01)
        assert old in list_segments()
        w = ShmRingWriter(1 << 16)  # a new P0 starts: stale segments go
        assert old not in list_segments()
        assert live_name in list_segments()  # a running writer's segment stays
        w.close()
    finally:
        p.wait(timeout=30)
        live.stdin.close()
        live.wait(timeout=30)
        for proc in (p, live):
            proc.stdout.close()
    assert live.returncode == 0 and live_name not in list_segments()  # closed at exit
    assert cleanup_stale_segments() == []


def test_reader_refuses_a_segment_others_can_touch():
    name = f"triptych-{os.getpid()}-1-1-{'0' * 16}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.ftruncate(fd, 8192)
        with pytest.raises(ValueError, match="private"):
            ShmRingReader(name)
        os.fchmod(fd, 0o600)
        with pytest.raises(ValueError, match="not a triptych"):
            ShmRingReader(name)  # private, but no ring header
    finally:
        os.close(fd)
        unlink_segment(name)
