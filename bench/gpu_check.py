"""`triptych bench gpu`: every check of the GPU path in one go, each step under its own limit.

    python -m triptych.bench.gpu_check --out DIR            # one GPU, < 8 minutes
    python -m triptych.bench.gpu_check --out DIR --cpu-smoke  # here: tiny shapes, interpreter

Each step runs in its own process (`--step NAME`) under its own time limit, so a step that
fails, hangs or takes the GPU down leaves the others running; each writes DIR/NAME.json
(and DIR/NAME.log), updated as it goes, so a step stopped at its limit keeps what it had.
Then DIR/summary.json and DIR/summary.md, a table for docs/performance.md.

| step    | checks |
| ------- | ------ |
| kernels | every Triton kernel against its torch reference, served shapes (bench/kernel_check.py) |
| parity  | greedy ids of each architecture equal HF's (its processor on raw images, then generate), fp32 on the device |
| engines | two engines in sequence in one process: the second starts after close() with the same KV blocks and ids |
| pools   | LLM with 1e1p1d and with E+PD on one device, default memory knobs: HF's greedy ids |
| model   | builds the random checkpoint in Qwen2-VL-2B's shape (on the GPU, bf16) the steps below serve |
| floor   | the decode step's GEMMs alone, eager and as one CUDA graph, batch 1/8/64/256 (bench floor) |
| syncs   | host syncs (`set_sync_debug_mode("warn")`) and device->host copies, syncs, launches per decode step (profiler) |
| decode  | decode-only tok/s at batch 1 and 64, as a fraction of the floor |
| ocr     | 64 requests x one 448 px image x 128 tokens, against HF generate (batch 16) on the device |
| ttft    | time to first token of one 448 px image chat, against HF generate |
| attn    | attention kernels' speed at the served shapes: decode % of copy bandwidth (bench/kernels.py) |
| train   | the demo model's training on the device: s/step with one drawing thread and with --data-procs (bench/gpu_train.py) |
| cudatests | the repo's GPU tests (those that skip without CUDA) under pytest (bench/cuda_tests.py) |
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# step -> (module in triptych.bench holding `step_<name>(ctx)`, its share of the default
# budget in seconds), in the order they run: the figures the issues ask for first (a
# budget that runs out loses the last steps), then the correctness sweeps. The shares sum
# to DEFAULT_BUDGET; each step gets its share of what is left when it starts, so time a
# step does not use goes to the ones after it (``step_limit``). Sized for a cold box:
# every engine compiles its Triton variants once at start (engine/runner/warmup.py), and the
# steps share Triton's on-disk cache (later steps load what earlier ones compiled).
STEPS: dict[str, tuple[str, int]] = {
    "model": ("gpu_speed", 20), "decode": ("gpu_speed", 60), "ttft": ("gpu_speed", 30),
    "syncs": ("gpu_speed", 30), "ocr": ("gpu_speed", 60), "floor": ("gpu_speed", 20),
    "attn": ("gpu_steps", 30), "kernels": ("gpu_steps", 40), "parity": ("gpu_steps", 45),
    "engines": ("gpu_steps", 20), "pools": ("gpu_steps", 45),
    "train": ("gpu_train", 35), "cudatests": ("cuda_tests", 40)}
DEFAULT_BUDGET = 475  # seconds: the run, installs and copies stay under the device tool's
# 10 minutes a command, with room in a 15-minute lease to rerun the steps that failed
MIN_STEP_S = 15  # a step is skipped when less than this is left of the budget


def step_limit(name: str, left: float, remaining: list[str], smoke: bool = False) -> float:
    """Seconds step ``name`` may run: its share of what is ``left`` among the steps still
    to run (``remaining``, itself first); a smoke run on the CPU gets three times as long
    per step (the interpreter), within what is left."""
    weights = [STEPS[s][1] for s in remaining]
    share = left * STEPS[name][1] / sum(weights)
    return min(left, share * (3 if smoke else 1))
# what the GPU machine may lack (../shared/gpu/wheels.sh downloads them): import name -> pip name
NEEDS = {"torch": "torch", "triton": "triton", "transformers": "transformers",
         "numpy": "numpy", "PIL": "pillow", "safetensors": "safetensors",
         "tokenizers": "tokenizers", "jinja2": "jinja2", "msgspec": "msgspec", "zmq": "pyzmq",
         "tqdm": "tqdm"}
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
           "--upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:/tmp/pkg && "
           "mkdir -p /tmp/pkg && ln -sfn \"$PWD\" /tmp/pkg/triptych")


def missing_packages() -> list[str]:
    """Each needed package that does not import (absent, or broken beside the others),
    with the reason. Imports only: the parent never touches the GPU (its CUDA context
    would take memory from the pools' shares)."""
    import importlib

    bad = []
    for mod, pip in NEEDS.items():
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - any import failure is a missing package
            bad.append(f"{pip} ({type(e).__name__}: {str(e)[:120]})")
    return bad


def versions() -> dict[str, str]:
    import platform

    out = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers"):
        out[mod] = getattr(sys.modules.get(mod), "__version__", "?")
    return out


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for each step's JSON and log, and the "
                                                "summary (summary.md, summary.json)")
    p.add_argument("--steps", default=",".join(STEPS),
                   help="comma-separated steps to run, in this order: " + ", ".join(STEPS))
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU (Triton under TRITON_INTERPRET=1): proves the "
                        "script end to end before a GPU sees it")
    p.add_argument("--budget", type=float, default=float(DEFAULT_BUDGET),
                   help="seconds for all steps together (default %(default)s); each step gets "
                        "its share of what is left when it starts (STEPS)")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)  # the child process's


def add_parser(sub: Any) -> None:
    _add_args(sub.add_parser("gpu", help="the GPU path's checks and figures in one go "
                                         "(issue 32): kernels, HF parity, pools, syncs, tok/s"))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        return _child(args.step, out, args.cpu_smoke)
    names = [s for s in args.steps.split(",") if s]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        print(f"unknown steps {unknown}: choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    lack = missing_packages()
    if lack:
        print(f"gpu_check: missing packages: {'; '.join(lack)}.\nDownload them with `bash "
              f"../shared/gpu/wheels.sh` (in the checkout), send .whl along, and start with\n"
              f"  {INSTALL}", file=sys.stderr)
        return 2
    env = versions()
    print(f"gpu_check: {', '.join(f'{k} {v}' for k, v in env.items())}; steps {', '.join(names)}"
          f" within {args.budget:.0f} s; figures in {out}", flush=True)
    t_end = time.monotonic() + args.budget
    results = []
    for i, name in enumerate(names):
        left = t_end - time.monotonic()
        if left < MIN_STEP_S:
            res = {"step": name, "ok": False, "summary": f"skipped: {left:.0f} s of the budget left"}
            _write(out / f"{name}.json", res)
        else:
            res = _run_step(name, out, args.cpu_smoke,
                            step_limit(name, left, names[i:], args.cpu_smoke))
        results.append(res)
        print(f"[{name}] {'ok' if res.get('ok') else 'FAILED' if res.get('ok') is False else '-'}"
              f" in {res.get('seconds', 0):.0f} s: {res.get('summary', '')}", flush=True)
    md = summary_md(results, args.cpu_smoke, env)
    (out / "summary.md").write_text(md)
    _write(out / "summary.json", {"versions": env, "steps": results})
    print("\n" + md)
    return 0 if all(r.get("ok") is not False for r in results) else 1


def summary_md(results: list[dict[str, Any]], smoke: bool, env: dict[str, str]) -> str:
    """The table for docs/performance.md: one row per step."""
    import datetime

    device = next((r["device"] for r in results if r.get("device")), "?")
    head = (f"GPU check on {device}, {datetime.date.today()}, "
            + ", ".join(f"{k} {v}" for k, v in env.items())
            + (" (--cpu-smoke: tiny shapes, not figures)" if smoke else "")
            + ": `python -m triptych.bench.gpu_check --out DIR`\n\n"
            "| step | status | s | result | target |\n| --- | --- | ---: | --- | --- |\n")
    status = {True: "ok", False: "**FAILED**", None: "-"}

    def target(r: dict[str, Any]) -> str:  # the issues' targets hold for the GPU figures only
        if "met" not in r or smoke:
            return ""
        return ("met" if r["met"] else "**not met**") + f": {r['target']}"

    return head + "".join(
        f"| {r['step']} | {status[r.get('ok')]} | {r.get('seconds', 0):.0f} | "
        f"{str(r.get('summary', '')).replace('|', '/')} | {target(r)} |\n" for r in results)


def _run_step(name: str, out: Path, smoke: bool, limit: float) -> dict[str, Any]:
    """One step in its own process group, stopped (with every process it started) at
    ``limit``; its JSON completed with the time taken and how it ended."""
    cmd = [sys.executable, "-m", "triptych.bench.gpu_check", "--out", str(out), "--step", name]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["TRIPTYCH_STEP_LIMIT"] = f"{limit:.0f}"  # what a step may spend (Ctx.limit)
    if smoke:
        cmd.append("--cpu-smoke")
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        # NOTE: run from the out folder: `-m` puts the working directory first on sys.path,
        # and a checkout's root holds folders named like other packages (kernels, models)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        try:  # the step and whatever it started and left (pool workers): gone before the next
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    res = json.loads(path.read_text()) if path.exists() else {"step": name}
    res["seconds"] = time.monotonic() - t0
    if rc is None:
        res.update(ok=False, summary=f"stopped at its {limit:.0f} s limit; "
                                     + res.get("summary", "nothing written"))
    elif rc != 0 and res.get("ok") is not False:
        res.update(ok=False, summary=f"exit {rc}: {_tail(out / f'{name}.log')}")
    _write(path, res)
    return res


def _tail(log: Path, n: int = 300) -> str:
    text = log.read_text(errors="replace").strip() if log.exists() else ""
    return text[-n:].replace("\n", " | ")


def _write(path: Path, res: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2, default=str))
    tmp.replace(path)


class Ctx:
    """What a step runs on: the device and dtype, the out folder, and its own JSON."""

    def __init__(self, name: str, out: Path, smoke: bool) -> None:
        self.name, self.out, self.smoke = name, out, smoke
        self.device = "cpu" if smoke else "cuda"
        self.limit = float(os.environ.get("TRIPTYCH_STEP_LIMIT", "600"))  # seconds it may run
        self.res: dict[str, Any] = {"step": name, "ok": None, "smoke": smoke}

    def save(self, **fields: Any) -> None:
        """Record ``fields`` now (a step stopped later keeps them)."""
        self.res.update(fields)
        _write(self.out / f"{self.name}.json", self.res)

    def load(self, step: str) -> dict[str, Any] | None:
        """Another step's results (None if it did not run or wrote nothing)."""
        path = self.out / f"{step}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def llm_knobs(self) -> dict[str, Any]:
        """Knobs every engine of the checks shares: one CPU thread on a smoke run (whose
        engines keep the CPU's attention backend: Triton under the interpreter is 10x
        slower, and tests/test_kernels.py runs it)."""
        return {"cpu_threads": 1} if self.smoke else {}


def _child(name: str, out: Path, smoke: bool) -> int:
    import importlib
    import traceback

    import torch

    if smoke:
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke on a CPU)", file=sys.stderr)
        return 2
    ctx = Ctx(name, out, smoke)
    ctx.save()
    try:
        getattr(importlib.import_module(f"triptych.bench.{STEPS[name][0]}"), f"step_{name}")(ctx)
    except Exception as e:  # noqa: BLE001 - the step's failure is its result, the others run
        traceback.print_exc()
        ctx.save(ok=False, summary=f"{type(e).__name__}: {str(e)[:300]}")
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(ap)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
