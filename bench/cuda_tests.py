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


# pytest's exit codes (pytest.ExitCode) and what each means here
EXIT = {0: "ok", 1: "tests failed", 2: "interrupted (a collection error: a file failed to "
        "import?)", 3: "pytest's internal error", 4: "usage error (an unknown flag?)",
        5: "no tests collected"}


def gpu_test_files(root: Any) -> list[str]:
    """The test files that ask ``cuda.is_available()`` (the others hold no GPU test)."""
    return sorted(str(p) for p in (root / "tests").glob("test_*.py")
                  if "cuda.is_available()" in p.read_text())


def run_gpu_tests(files: list[str], log: Any, env: dict[str, str], timeout: float,
                  cwd: Any, extra: list[str] | None = None) -> tuple[int | None, list[dict]]:
    """pytest over ``files`` with this plugin (their GPU tests only): its exit code (None
    when stopped at ``timeout``) and one row per finished test."""
    import subprocess
    import sys

    log.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *files, "-n", "0", "-q", "-rfEs",
                             "-p", "no:cacheprovider", "-p", "triptych.bench.cuda_tests",
                             *(extra or [])], cwd=cwd, env={**env, LOG_ENV: str(log)})
    try:  # stop in time to report what ran (the runner stops the step at its limit)
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    rows = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    return rc, rows


def verdict(rc: int | None, rows: list[dict], smoke: bool) -> tuple[bool, dict[str, int], str]:
    """(ok, counts, why not): pytest must exit 0 and the GPU tests must have run: on a GPU
    at least one passed and none failed; on a smoke run (no GPU) each was collected and
    skipped. An empty log with exit 0 is no proof: 0 tests run is a failure."""
    count = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "skipped", "failed")}
    if rc is None:
        return False, count, "stopped at its limit"
    if rc != 0:
        return False, count, f"pytest exited {rc}: {EXIT.get(rc, 'unknown')}"
    if count["failed"]:
        return False, count, f"{count['failed']} failed"
    ran = count["skipped"] if smoke else count["passed"]
    if not ran:
        return False, count, "0 GPU tests " + ("collected" if smoke else "ran")
    return True, count, ""


def step_cudatests(ctx: Any) -> None:
    """The files that mention ``cuda.is_available()``, their GPU tests only, with the
    compiled kernels (TRITON_INTERPRET=0: conftest would turn the interpreter on)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]  # the repository root is the package
    files = gpu_test_files(root)
    env = dict(os.environ, TRITON_INTERPRET="1" if ctx.smoke else "0")
    rc, rows = run_gpu_tests(files, ctx.out / "cudatests.jsonl", env, max(ctx.limit - 10, 5),
                             root)
    ok, count, why = verdict(rc, rows, ctx.smoke)
    failed = [r["test"].split("/")[-1] for r in rows if r["outcome"] == "failed"]
    names = ", ".join(Path(f).name for f in files)
    ctx.save(ok=ok, files=[Path(f).name for f in files], **count, pytest_exit=rc,
             failed_tests=failed, summary=(f"{why}; " if why else "") +
             f"{count['passed']} passed, {count['skipped']} skipped, {count['failed']} failed "
             f"GPU tests in {names}" + (f": {', '.join(failed[:6])}" if failed else ""))
