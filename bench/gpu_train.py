"""The demo model's training on the GPU (`bench gpu` step ``train``, bench/gpu_check.py).

Issue 43 asks for the demo's training on a GPU in minutes instead of the CPU's hours. A
step of the last phase's mix trains in milliseconds there, and drawing it (rendering, the
layout step, the image processor) takes one core ~0.1-0.2 s: so this step times two short
runs of that mix from the shipped weights on the device, side by side,

- one drawing thread (``--data-procs 0``, the peer: what the GPU gets without help), and
- ``--data-procs N``, one process per core but one (demo/data_procs.py),

and records each one's seconds per step (from the training log, after the first steps),
their ratio, and the recipe's steps at the faster rate (the minutes a whole recipe would
train, evaluations aside). On ``--cpu-smoke`` both run a few steps on the CPU.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

# (steps, the step from which the rate is measured), per run; the smoke run's are tiny
STEPS = {"single": (60, 20), "procs": (240, 40)}
SMOKE_STEPS = {"single": (4, 1), "procs": (6, 2)}
LINE = re.compile(r"^step (\d+) loss \S+ .* ([\d.]+)s$")


def rate(log: str, start: int) -> tuple[float, int]:
    """(seconds per step, steps timed) from a training log's ``step N ... Xs`` lines,
    from step ``start`` to the last one logged."""
    points = [(int(m[1]), float(m[2])) for m in map(LINE.match, log.splitlines()) if m]
    points = [p for p in points if p[0] >= start]
    if len(points) < 2:
        raise RuntimeError(f"too few step lines after step {start}: {log[-500:]}")
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (t1 - t0) / (s1 - s0), s1 - s0


def recipe_steps() -> int:
    from triptych.demo.train import RECIPE

    return sum(min(p.get("steps", 6000), p.get("max_steps") or p.get("steps", 6000))
               for p in RECIPE)


def run(ctx: Any, out: str, procs: int, steps: int, log_every: int, limit: float) -> str:
    from triptych.models.demo import demo_checkpoint

    cmd = [sys.executable, "-m", "triptych.demo.train", "--out", out, "--init",
           demo_checkpoint(), "--steps", "6000", "--max-steps", str(steps), "--lr", "5e-4",
           "--ramp", "0", "--pages-from", "0", "--crop-pages", "--random-share", "0.3",
           "--strips", "0.75", "--device", ctx.device, "--data-procs", str(procs),
           "--threads", "1", "--eval-every", "0", "--eval-lines", "1", "--eval-pages", "1",
           "--eval-dev", "1", "--save-every", "0", "--log-every", str(log_every)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(limit, 5))
    if r.returncode:
        raise RuntimeError(f"training with --data-procs {procs} failed: {r.stderr[-600:]}")
    return r.stdout


def step_train(ctx: Any) -> None:
    plan = SMOKE_STEPS if ctx.smoke else STEPS
    procs = 2 if ctx.smoke else max(1, (os.cpu_count() or 2) - 1)
    every = 1 if ctx.smoke else 10
    deadline = time.monotonic() + ctx.limit - 5
    rows = []
    for name, n in (("single", 0), ("procs", procs)):
        steps, start = plan[name]
        log = run(ctx, str(ctx.out / f"train-{name}"), n, steps, every,
                  deadline - time.monotonic())
        s, timed = rate(log, start)
        rows.append({"run": name, "data_procs": n, "s_per_step": round(s, 4),
                     "steps_timed": timed})
        ctx.save(rows=rows)
    speedup = rows[0]["s_per_step"] / max(rows[1]["s_per_step"], 1e-9)
    total = recipe_steps()
    minutes = total * min(r["s_per_step"] for r in rows) / 60
    ctx.save(ok=True, rows=rows, speedup=round(speedup, 2), recipe_steps=total,
             recipe_minutes=round(minutes, 1),
             summary=f"{rows[1]['s_per_step'] * 1000:.0f} ms a step with {procs} data "
                     f"processes, {speedup:.1f}x one drawing thread "
                     f"({rows[0]['s_per_step'] * 1000:.0f} ms): the recipe's "
                     f"{total:,} steps in ~{minutes:.0f} min on {ctx.device}")
