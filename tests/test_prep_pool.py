"""The preparation processes beside P0 (api/prep_pool.py, issue 41 point 1; issue 42 row
4), driven directly: pixels equal to the in-process path's, written once to a shared-memory
segment that P0 adopts and unlinks; a job past its deadline or its memory cap, or one whose
process crashes, fails alone and the process is replaced, leaving no segment; tenants are
served in turns; a killed server leaves no process, and its segments go at the next start."""
from __future__ import annotations

import io
import os
import signal
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, alive, data_url, image_part, text_part, user, wait_for
from triptych.api.media.limits import MediaError, MediaLimits
from triptych.api.prep_pool import PrepPool
from triptych.api.prep_proc import Job
from triptych.api.processor import InputProcessor
from triptych.bench.attacks import slow_jpeg
from triptych.mmcache.shm_ring import read_item
from triptych.mmcache.shm_segment import list_segments, segments_of


def jpeg(seed: int, w: int = 300, h: int = 200) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pool(tiny_qwen2_vl):
    p = PrepPool(tiny_qwen2_vl, 1, deadline_s=2.0, memory_bytes=2 << 30)
    yield p
    p.close()
    assert not p.pids


def test_pixels_equal_the_in_process_path_and_the_segment_goes_with_its_owner(
        pool, tiny_qwen2_vl):
    data = jpeg(1)
    done, prepared = pool.run(Job("image", "k" * 64, data, MediaLimits().caps()))
    here = InputProcessor(tiny_qwen2_vl)._process_here("image", "k" * 64, data)[0]
    assert tuple(done.grid) == here.grid_thw and done.shape == list(here.pixel_values.shape)
    assert torch.equal(read_item(prepared.ref(None), "k" * 64), here.pixel_values)
    name = prepared.name
    assert name in list_segments() and name.startswith(f"triptych-{os.getpid()}-")  # P0's
    prepared.release()
    assert name not in list_segments()


def test_bad_media_fail_alone_with_the_decoders_words(pool):
    with pytest.raises(MediaError, match="cannot decode image"):
        pool.run(Job("image", "b" * 64, b"\x89PNG not really", MediaLimits().caps()))
    assert pool.run(Job("image", "c" * 64, jpeg(2), MediaLimits().caps()))[1] is not None


def test_a_job_past_its_deadline_is_killed_alone_and_leaves_nothing(pool):
    before, killed = pool.pids, pool.num_killed
    with pytest.raises(MediaError, match="--max-image-decode-seconds"):
        pool.run(Job("image", "s" * 64, slow_jpeg(4500), MediaLimits().caps()))  # (~6 s)
    assert pool.num_killed == killed + 1 and not alive(before[0])
    assert not segments_of(before[0])
    _, prepared = pool.run(Job("image", "d" * 64, jpeg(3), MediaLimits().caps()))
    assert pool.pids and pool.pids != before and prepared is not None  # replaced


def test_the_deadline_counts_cpu_time_not_waiting_and_a_stuck_process_still_goes(
        tiny_qwen2_vl):
    """A preparation process held off the CPU (SIGSTOP: as a busy host holds one that runs
    at a lower priority) for 4x its deadline still prepares its image; one that never runs
    again is stopped at STALL_FACTOR x the deadline."""
    from triptych.api.prep_pool import STALL_FACTOR

    p = PrepPool(tiny_qwen2_vl, 1, deadline_s=0.5)
    try:
        p.run(Job("image", "w" * 64, jpeg(5), MediaLimits().caps()))[1].release()  # warm
        pid = p.pids[0]
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(2.0, os.kill, (pid, signal.SIGCONT)).start()
        _, prepared = p.run(Job("image", "x" * 64, jpeg(6), MediaLimits().caps()))
        assert prepared is not None and p.num_killed == 0 and p.pids == [pid]
        prepared.release()
        assert STALL_FACTOR * 0.5 > 2.0
        os.kill(pid, signal.SIGSTOP)  # and never again
        with pytest.raises(MediaError, match="--max-image-decode-seconds"):
            p.run(Job("image", "y" * 64, jpeg(7), MediaLimits().caps()))
        assert p.num_killed == 1 and not alive(pid) and not segments_of(pid)
    finally:
        p.close()


def test_a_job_over_the_memory_cap_is_killed(tiny_qwen2_vl):
    small = PrepPool(tiny_qwen2_vl, 1, deadline_s=60.0, memory_bytes=64 << 20)
    try:  # (the process alone, torch imported, is above 64 MiB: the first job trips it)
        with pytest.raises(MediaError, match="--mm-processor-memory"):
            small.run(Job("image", "m" * 64, jpeg(4), MediaLimits().caps()))
    finally:
        small.close()


def test_tenants_take_turns(tiny_qwen2_vl):
    """The one process busy, alice queues 6 jobs, then bob 1: bob's is served first or
    second of the seven, not seventh."""
    fair = PrepPool(tiny_qwen2_vl, 1, deadline_s=60.0)
    order: list[str] = []
    lock = threading.Lock()

    def one(tenant: str, i: int, data: bytes) -> None:
        fair.run(Job("image", f"{tenant}{i}".ljust(64, "0"), data, MediaLimits().caps()),
                 tenant)
        with lock:
            order.append(tenant)

    try:
        fair.run(Job("image", "w" * 64, jpeg(5), MediaLimits().caps()))  # (started)
        busy = threading.Thread(target=one, args=("carol", 0, slow_jpeg(400)))
        busy.start()
        wait_for(lambda: fair.num_running == 1, "carol's job to run")
        # alice's jobs take ~0.1 s each, so the order the threads record (each after its
        # job returns) is the order the process served them, whatever the wake-ups' delay
        threads = [threading.Thread(target=one, args=("alice", i, slow_jpeg(15)))
                   for i in range(6)]
        for t in threads:
            t.start()
        wait_for(lambda: len(fair._queues.get("alice", ())) == 6, "alice's jobs queued")
        threads.append(threading.Thread(target=one, args=("bob", 0, jpeg(20))))
        threads[-1].start()
        for t in [busy, *threads]:
            t.join(120)
        assert order[0] == "carol" and "bob" in order[1:3], order
    finally:
        fair.close()


def test_a_killed_server_leaves_no_process_and_its_segments_go_at_the_next_start(
        tiny_qwen2_vl, tmp_path):
    """kill -9 while an image's pixels are in shared memory: the preparation process ends
    with its server (PR_SET_PDEATHSIG), and the segment the dead server held is swept by
    the next server's pool."""
    import httpx

    s = ServerProc(tiny_qwen2_vl, tmp_path / "a.log", "--max-model-len", "512",
                   "--mm-processor-workers", "1")
    body = {"messages": user(image_part(data_url(jpeg(7), "image/jpeg")), text_part("x")),
            "n": 16, "max_tokens": 400, "ignore_eos": True}
    try:
        assert not httpx.get(s.base + "/health", timeout=5).json()["preparation"]["pids"]
        cut: list[BaseException] = []  # the kill cuts this request off

        def send() -> None:
            try:
                httpx.post(s.base + "/v1/chat/completions", json=body, timeout=120)
            except httpx.HTTPError as e:
                cut.append(e)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        wait_for(lambda: segments_of(s.proc.pid), "the image's pixels in shared memory")
        prep = httpx.get(s.base + "/health", timeout=5).json()["preparation"]["pids"]
        assert prep  # started by the image (a text-only server has none)
        s.stop(signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in prep), "the preparation process to end",
                 timeout=30)
        left = segments_of(s.proc.pid)
        assert left  # the dead server's
        t.join(timeout=30)
        assert cut  # (its answer never came)
    finally:
        s.stop(signal.SIGKILL)
        s.cleanup_descendants()
    PrepPool(tiny_qwen2_vl, 0).close()  # a new server's pool sweeps what the dead one left
    assert not [n for n in left if n in list_segments()]
