"""Who may join from another host (issue 15, point 7), with real processes: a `triptych
worker` whose key is named like a local worker (decode-0) is refused and the local one keeps
serving; a worker with another checkpoint of the same shape (another seed) is refused
before it joins (its Hello's model fingerprint is not the server's)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, alive, free_port, text_part, user, wait_for  # noqa: E402


def _worker(model: str, keys: str, name: str, router: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "triptych", "worker", "--pool", "decode", "--name", name,
         "--router", router, "--model", model, "--block-size", "4", "--max-model-len", "512",
         "--kv-transfer", "tcp", "--worker-keys", keys, "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT)


def test_a_colliding_name_and_another_checkpoint_are_refused(tiny_qwen2_vl, tmp_path):
    from triptych.connector.auth import generate_keys
    from triptych.models.tiny import make_tiny

    other = make_tiny("qwen2_vl", str(tmp_path / "other"), seed=1)  # same shape, other weights
    keys = str(tmp_path / "keys")
    generate_keys(keys, ["router", "prefill-0", "decode-0", "decode-h4"])
    router = f"tcp://127.0.0.1:{free_port()}"
    s = ServerProc(tiny_qwen2_vl, tmp_path / "serve.log", "--block-size", "4",
                   "--max-model-len", "512", "--prefill-workers", "1", "--decode-workers",
                   "1", "--kv-transfer", "tcp", "--worker-address", router,
                   "--worker-keys", keys, "--served-model-name", "tiny")
    log = open(tmp_path / "workers.log", "w")  # noqa: SIM115
    procs: list[subprocess.Popen] = []
    try:
        local_pid = s.worker_pids()["decode-0"]
        procs.append(_worker(tiny_qwen2_vl, keys, "decode-0", router, log))
        procs.append(_worker(other, keys, "decode-h4", router, log))
        text = lambda: s.log_path.read_text()  # noqa: E731
        wait_for(lambda: "refused worker decode-0#" in text() and
                 "refused worker decode-h4#" in text(), "both refusals", timeout=180)
        assert "is a local worker's" in text() and "another checkpoint" in text()
        workers = httpx.get(s.base + "/health", timeout=5).json()["pools"]["decode"]["workers"]
        assert [(w["name"], w["remote"], w["pid"], w["state"]) for w in workers] == \
            [("decode-0", False, local_pid, "up")]
        r = httpx.post(s.base + "/v1/chat/completions", timeout=120,
                       json={"messages": user(text_part("still ours?")), "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert all(p.poll() is None for p in procs)  # refused, not crashed: still knocking
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        log.close()
        s.stop(signal.SIGTERM)
        s.cleanup_descendants()
    assert not any(alive(p.pid) for p in procs)
