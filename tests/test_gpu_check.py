"""The GPU check script (`triptych bench gpu`, bench/gpu_check.py) end to end on the CPU.

Its --cpu-smoke mode runs the cheap steps at tiny shapes (Triton under the interpreter):
each step in its own process writes its JSON, and the summary has one row per step, so a
typo never reaches the scarce GPU. A step with no budget left is skipped, not run.
"""
from __future__ import annotations

import json
import subprocess
import sys

CHEAP = ["kernels", "model", "floor", "syncs", "decode"]


def run_check(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triptych.bench.gpu_check", "--out", str(out),
                           "--cpu-smoke", *args], capture_output=True, text=True, timeout=600,
                          check=False)


def test_the_cheap_steps_run_end_to_end(tmp_path):
    r = run_check(tmp_path, "--steps", ",".join(CHEAP))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [s["step"] for s in steps] == CHEAP
    assert all(s["ok"] for s in steps), steps
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["passed"] == kernels["total"] > 0
    floor = json.loads((tmp_path / "floor.json").read_text())
    assert [r["batch"] for r in floor["rows"]] == [1, 8, 64, 256]
    assert floor["graphs"].startswith("skipped")  # no CUDA here: eager only, with the reason
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert all(r["tok_s"] > 0 and "of_eager_floor" in r for r in decode["rows"])
    syncs = json.loads((tmp_path / "syncs.json").read_text())
    assert syncs["dtoh_copies_per_step"] == 0  # the CPU copies nothing to a host
    table = (tmp_path / "summary.md").read_text()
    assert all(f"| {name} | ok |" in table for name in CHEAP), table


def test_a_step_past_the_budget_is_skipped(tmp_path):
    r = run_check(tmp_path, "--steps", "floor", "--budget", "0")
    assert r.returncode == 1
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert step["ok"] is False and step["summary"].startswith("skipped")
    assert not (tmp_path / "floor.log").exists()
