"""Ray engines one after another in one process (issue 34, point 3): notebooks, evaluation
scripts and test suites make ``LLM(..., distributed_executor_backend="ray")`` engines in
sequence. Each must answer as the in-process engine does and leave nothing in Ray once
``close()`` returns, or once ``del llm; gc.collect()`` has freed it (issue 44: the second
engine is freed that way, and the failed start after it still finds every CPU free); a
start that fails must say what failed and leave nothing either.

One script per test, in a process of its own (it is a Ray driver; this test process
stays none), as a user would run it: on a Ray the script started itself (the cluster
outlives each engine: its tables must show every placement group removed and every actor
dead), and on the Ray each engine starts for itself (gone with the engine).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

SCRIPT = r'''
import gc, json, os, sys, threading
sys.path.insert(0, TESTS)
import ray
from server_fixtures import image_chat, img
from triptych import LLM, SamplingParams

def ours():
    """This process's placement groups and actors as Ray's tables show them."""
    if not ray.is_initialized():
        return None
    from ray._private.state import actors
    pgs = {p["name"]: p["state"] for p in ray.util.placement_group_table().values()
           if p["name"].startswith(f"triptych-{os.getpid()}-")}
    return {"pgs": pgs, "actors": sorted(a["State"] for a in actors().values()
                                         if a["ActorClassName"] == "PoolWorkerActor")}

def answers(llm):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    text = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    seen = llm.chat(image_chat("What is it?", img(3, 64, 48)), sp, use_tqdm=False)[0]
    return [list(text.outputs[0].token_ids), list(seen.outputs[0].token_ids)]

if OWN_RAY:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
knobs = dict(kv_cache_memory="32MiB", max_model_len=512)
out = {"reference": None, "engines": [], "failed": None}
with LLM(MODEL, **knobs) as llm:  # the in-process engine: the answers to match
    out["reference"] = answers(llm)
for how in ("close", "del"):  # close(), then as notebooks free an engine: del + gc
    llm = LLM(MODEL, distributed_executor_backend="ray", encode_workers=1,
              decode_workers=1, **knobs)
    got, live = answers(llm), ours()
    if how == "close":
        llm.close()
    else:
        del llm
        gc.collect()
    out["engines"].append({"answers": got, "live": live, "after_close": ours(),
                           "ray_up": ray.is_initialized(), "how": how,
                           "threads": sorted(t.name for t in threading.enumerate())})
try:  # the second worker's bundle is one Ray refuses: the first must go as well
    LLM(MODEL, distributed_executor_backend="ray", encode_workers=1, decode_workers=1,
        decode_resources='{"CPU": 0}', **knobs)
except Exception as e:
    out["failed"] = {"type": type(e).__name__, "message": str(e), "after": ours(),
                     "threads": sorted(t.name for t in threading.enumerate())}
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.parametrize("own_ray", [True, False], ids=["script-ray", "engine-ray"])
def test_two_ray_engines_in_one_process_then_a_failed_start(tiny_qwen2_vl, tmp_path,
                                                             own_ray):
    script = tmp_path / "two_engines.py"
    script.write_text(f"TESTS = {os.path.dirname(__file__)!r}\nMODEL = {tiny_qwen2_vl!r}\n"
                      f"OWN_RAY = {own_ray}\n" + SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=600, env=env, check=False)  # a hang guard
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    a, b = out["engines"]
    assert (a["how"], b["how"]) == ("close", "del")  # b was freed by `del llm; gc.collect()`
    assert a["answers"] == b["answers"] == out["reference"]
    assert "triptych-router" not in b["threads"], b
    if own_ray:  # the cluster stays: close() returned with Ray showing nothing of ours
        assert a["ray_up"] and b["ray_up"]
        names_a, names_b = ({n for n, state in e["live"]["pgs"].items() if state == "CREATED"}
                            for e in (a, b))
        assert len(names_a) == len(names_b) == 2 and not names_a & names_b  # its own names
        for e in (a, b):
            assert set(e["after_close"]["pgs"].values()) == {"REMOVED"}, e
            assert set(e["after_close"]["actors"]) == {"DEAD"}, e
    else:  # each engine started a Ray of its own and stopped it
        assert not a["ray_up"] and not b["ray_up"]
        assert a["after_close"] is None and b["after_close"] is None
    f = out["failed"]
    assert f is not None and f["type"] == "ClusterError", out
    assert f["message"].startswith("Ray could not start worker decode-0: ") and \
        "CPU" in f["message"], f
    assert "triptych-router" not in f["threads"] and "zap" not in f["threads"], f
    if own_ray:
        assert set(f["after"]["pgs"].values()) <= {"REMOVED"}, f  # encode-0's too
        assert set(f["after"]["actors"]) == {"DEAD"}, f
    else:
        assert f["after"] is None, f  # the Ray it started is stopped again
