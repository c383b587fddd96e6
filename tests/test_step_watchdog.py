"""Every wait has a deadline (issue 15, point 2), against the real server: a worker whose
step never returns while its heartbeat goes on (the test hook TRIPTYCH_TEST_HANG_STEP
hangs the first step of the worker incarnation it names). The request waiting on it fails
at --first-token-timeout with a 503 naming the flag and holds nothing afterwards; past
--max-step-seconds the supervisor kills the hung worker and starts a new one, which serves
the next request (its greedy tokens equal an undisturbed worker's). Then the last worker
is frozen (``kill -STOP``): past --worker-heartbeat-timeout it is killed, and the request
waiting on it ends with a clear 503 (no live worker left) rather than hanging."""
from __future__ import annotations

import os
import signal
import sys

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, alive, text_part, user, wait_for

BODY = {"model": "tiny", "messages": user(text_part("Count the hills.")), "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}


def _workers(s: ServerProc) -> list[dict]:
    return httpx.get(s.base + "/health", timeout=5).json()["pools"]["colocated"]["workers"]


def test_a_hung_step_fails_its_wait_and_the_worker_is_replaced(tiny_qwen2_vl, tmp_path):
    from triptych import LLM, SamplingParams

    llm = LLM(tiny_qwen2_vl, block_size=4, max_model_len=512)  # an undisturbed engine
    want = llm.chat(BODY["messages"], SamplingParams(temperature=0, max_tokens=6,
                                                     ignore_eos=True), use_tqdm=False)
    want_text = want[0].outputs[0].text
    llm.close()
    s = ServerProc(tiny_qwen2_vl, tmp_path / "serve.log", "--block-size", "4",
                   "--max-model-len", "512", "--served-model-name", "tiny",
                   "--first-token-timeout", "8", "--max-step-seconds", "16",
                   "--worker-heartbeat-timeout", "3",
                   env={"TRIPTYCH_TEST_HANG_STEP": "colocated-0#0"})
    frozen = None
    try:
        (w0,) = _workers(s)
        hung = w0["pid"]
        r = httpx.post(s.base + "/v1/chat/completions", json=BODY, timeout=300)  # hang guard
        assert r.status_code == 503, r.text
        assert "--first-token-timeout" in r.json()["error"]["message"]
        assert s.metric("triptych:first_token_timeouts_total") == 1
        # nothing of it is held: no worker is charged with it any more
        assert all(w["requests"] == 0 for w in _workers(s))
        # the hung worker still heartbeats; past --max-step-seconds it is killed, replaced
        w = wait_for(lambda: next((w for w in _workers(s)
                                   if w["state"] == "up" and w["pid"] != hung), None),
                     "the hung worker's replacement", timeout=180)
        assert not alive(hung) and w["restarts"] == 1
        assert "inside one step" in s.log_path.read_text()
        r = httpx.post(s.base + "/v1/chat/completions", json=BODY, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want_text
        # the last worker frozen: its request fails with a clear error, well before the
        # first-token deadline (the heartbeat timeout catches it first), and is not lost
        frozen = w["pid"]
        os.kill(frozen, signal.SIGSTOP)
        r = httpx.post(s.base + "/v1/chat/completions", json=BODY, timeout=300)  # hang guard
        assert r.status_code == 503, r.text
        assert "no live worker" in r.json()["error"]["message"]
        assert s.metric("triptych:first_token_timeouts_total") == 1
        wait_for(lambda: not alive(frozen), "the frozen worker to be killed")
    finally:
        if frozen is not None and alive(frozen):
            os.kill(frozen, signal.SIGCONT)
        s.stop(signal.SIGTERM, timeout=60)
        s.cleanup_descendants()
