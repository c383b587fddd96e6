"""`bench gpu`'s step cudatests: the repo's tests that need a GPU, under pytest, on one.

The tests that skip without CUDA (a ``skipif`` whose reason names CUDA or a GPU) are the
ones no CPU run exercises; this module is also the pytest plugin (``-p``) that keeps only
them, so the files' CPU tests (which CI runs) cost the GPU's time nothing.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

_NEEDS_GPU = re.compile(r"cuda|gpu", re.IGNORECASE)
LOG_ENV = "TRIPTYCH_CUDA_TESTS_LOG"  # where the plugin writes one line per finished test


def needs_gpu(item: Any) -> bool:
    return any(_NEEDS_GPU.search(str(m.kwargs.get("reason", "")))
               for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """(pytest hook) Deselect every test that would run without a GPU."""
    drop = [it for it in items if not needs_gpu(it)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if needs_gpu(it)]


def pytest_runtest_logreport(report: Any) -> None:
    """(pytest hook) One JSON line per test as it ends: a run stopped at its limit keeps
    what had finished."""
    path = os.environ.get(LOG_ENV)
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "when": report.when,
                                "outcome": report.outcome}) + "\n")


def step_cudatests(ctx: Any) -> None:
    """The files that mention ``cuda.is_available()``, their GPU tests only, with the
    compiled kernels (TRITON_INTERPRET=0: conftest would turn the interpreter on)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]  # the repository root is the package
    files = sorted(str(p) for p in (root / "tests").glob("test_*.py")
                   if "cuda.is_available()" in p.read_text())
    log = ctx.out / "cudatests.jsonl"
    log.unlink(missing_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="1" if ctx.smoke else "0", **{LOG_ENV: str(log)})
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *files, "-n", "0", "-q", "-rfEs",
                             "-p", "no:cacheprovider", "-p", "triptych.bench.cuda_tests"],
                            cwd=root, env=env)
    try:  # stop in time to report what ran (the runner stops the step at its limit)
        proc.wait(timeout=max(ctx.limit - 10, 5))
        stopped = ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        stopped = f"stopped after {ctx.limit - 10:.0f} s; "
    rows = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    count = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "skipped", "failed")}
    failed = [r["test"].split("/")[-1] for r in rows if r["outcome"] == "failed"]
    names = ", ".join(Path(f).name for f in files)
    ctx.save(ok=not failed and not stopped, files=[Path(f).name for f in files], **count,
             failed_tests=failed, summary=f"{stopped}{count['passed']} passed, "
             f"{count['skipped']} skipped, {count['failed']} failed GPU tests in {names}"
             + (f": {', '.join(failed[:6])}" if failed else ""))
