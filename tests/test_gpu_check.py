"""The GPU check script (`triptych bench gpu`, bench/gpu_check.py) end to end on the CPU.

Its --cpu-smoke mode runs the steps at tiny shapes: each step in its own process writes
its JSON, and the summary has one row per step, so a typo never reaches the scarce GPU.
The figure steps' engines start and step as CUDA engines do, rehearsed on the CPU
(bench/gpu_rehearsal.py: profile run, trial capture, KV sizing, warm-up, graph capture
with eager replays, packed staging, async scheduling). The step limits fit the budget; a
step with no budget left is skipped, not run; the GPU tests' step fails when pytest does
or when no test ran.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from triptych.bench import cuda_tests
from triptych.bench.gpu_check import DEFAULT_BUDGET, MIN_STEP_S, STEPS, step_limit

CHEAP = ["kernels", "model", "floor", "syncs", "decode", "train"]


def run_check(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triptych.bench.gpu_check", "--out", str(out),
                           "--cpu-smoke", *args], capture_output=True, text=True, timeout=900,
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
    assert all(r["tok_s"] > 0 for r in decode["rows"])
    assert all("of_eager_floor" in r for r in decode["rows"] if r["batch"] == 1)
    assert [r["mode"] for r in decode["rows"]] == ["eager"] * 2 + ["graphs"] * 2
    assert all(r["async"] and 0 < r["host_ms"] <= r["step_ms"] for r in decode["rows"])
    # started as a CUDA engine: sized by a profile run (with a trial capture), warmed up,
    # graphs captured (rehearsed) for the graphs rows
    start = decode["rehearsal"]
    assert start["kv_blocks"] > 0 and start["warm_up_steps"] > 0
    assert start["graph_sizes"] == [1, 4]
    syncs = json.loads((tmp_path / "syncs.json").read_text())
    assert syncs["dtoh_copies_per_step"] == 0  # the CPU copies nothing to a host
    train = json.loads((tmp_path / "train.json").read_text())  # the demo's training, timed
    assert [r["data_procs"] for r in train["rows"]] == [0, 2]
    assert all(r["s_per_step"] > 0 and r["steps_timed"] > 0 for r in train["rows"])
    assert train["recipe_steps"] == 28500 and train["recipe_minutes"] > 0
    table = (tmp_path / "summary.md").read_text()
    assert all(f"| {name} | ok |" in table for name in CHEAP), table


def test_a_step_past_the_budget_is_skipped(tmp_path):
    r = run_check(tmp_path, "--steps", "floor", "--budget", "0")
    assert r.returncode == 1
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert step["ok"] is False and step["summary"].startswith("skipped")
    assert not (tmp_path / "floor.log").exists()


@pytest.mark.parametrize("budget", [DEFAULT_BUDGET, 300, 120])
def test_step_limits_fit_the_budget(budget):
    """Every step may run to its limit and the run still ends within the budget; the
    figures come first, and time a step leaves goes to the later ones."""
    names = list(STEPS)
    assert sum(w for _, w in STEPS.values()) == DEFAULT_BUDGET
    assert names[:3] == ["model", "decode", "ttft"] and names[-1] == "cudatests"
    left, limits = float(budget), []
    for i, name in enumerate(names):
        if left < MIN_STEP_S:
            break
        limits.append(step_limit(name, left, names[i:]))
        left -= limits[-1]
    assert sum(limits) <= budget + 1e-6
    if budget == DEFAULT_BUDGET:
        assert len(limits) == len(names)
        assert limits == pytest.approx([w for _, w in STEPS.values()])
    # a step that takes half its limit leaves the rest to the steps after it
    quick = step_limit("decode", DEFAULT_BUDGET - 10, names[1:])  # model took 10 of its 20
    assert quick > STEPS["decode"][1]


def test_the_gpu_tests_step_fails_unless_tests_ran(tmp_path):
    """pytest exiting non-zero (a file that does not import, an unknown flag) or no test
    run is a failure of the step, whatever the (empty) log says."""
    log = tmp_path / "log.jsonl"
    root = Path(cuda_tests.__file__).resolve().parents[1]
    env = {k: v for k, v in __import__("os").environ.items()}
    broken = tmp_path / "test_broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    rc, rows = cuda_tests.run_gpu_tests([str(broken)], log, env, 120, root)
    assert rc == 2 and rows == []
    ok, _, why = cuda_tests.verdict(rc, rows, smoke=True)
    assert not ok and "exited 2" in why
    rc, rows = cuda_tests.run_gpu_tests([str(broken)], log, env, 120, root,
                                        ["--no-such-flag"])
    assert rc == 4 and not cuda_tests.verdict(rc, rows, smoke=True)[0]
    files = cuda_tests.gpu_test_files(root)
    assert "tests/test_kv_blocks_io.py" in " ".join(files)
    rc, rows = cuda_tests.run_gpu_tests(files[:1], log, env, 300, root)
    ok, count, why = cuda_tests.verdict(rc, rows, smoke=True)  # (no GPU: collected, skipped)
    assert ok and count["skipped"] > 0 and count["passed"] == 0, why
    assert not cuda_tests.verdict(rc, rows, smoke=False)[0]  # on a GPU, 0 passed fails
    assert not cuda_tests.verdict(0, [], smoke=True)[0]  # nothing ran
    assert not cuda_tests.verdict(None, rows, smoke=True)[0]  # stopped at its limit
