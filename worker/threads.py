"""Thread policy: how many CPU threads each torch process uses, and how its threads wait.

Every process that runs torch (the colocated engine, each pool worker, each TP rank) calls
``apply_thread_policy`` at start; whoever spawns such a process passes it
``thread_env(n, os.environ)``; several workers on one host split the cores with
``divide_cores`` instead of each taking them all.

Why it matters (docs/performance.md, measured on the 2-core dev box shared with other
users, torch 2.13 CPU wheel, which links GNU OpenMP ``libgomp``; MKL runs on that pool):

- An OpenMP parallel region ends at a barrier. With more runnable threads than free
  cores (another tenant, the API process, a second worker), one of our threads is often
  descheduled and the others wait for it. Threads that finished their share spin before
  they sleep, taking the core the straggler needs: libgomp's default (300k spins) made
  the OCR benchmark ~20x slower next to one busy process (75 vs 1,500 output tok/s);
  a bounded 10k spin was still ~4x slower; ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once)
  was the fastest both next to the busy process and on the merely shared box.
- Fewer threads than busy cores avoids the straggler entirely: split the host's cores
  between workers (``divide_cores``) instead of giving each all of them.

What can change when:
- ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` (and ``KMP_BLOCKTIME`` for wheels built with
  Intel OpenMP) are read once, when the OpenMP runtime loads, i.e. at ``import torch``.
  Setting them later has no effect: put them in the child's environment (``thread_env``)
  or set them before the first torch import (the CLI does, see ``early_env``).
- Intra-op threads (``torch.set_num_threads``) can change at any time.
- Inter-op threads (``torch.set_num_interop_threads``) can be set once, before any
  inter-op work; later calls raise, and we then keep what torch has.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from triptych.worker.allocator import apply_allocator_policy

logger = logging.getLogger("triptych.threads")

# Variables that choose how idle OpenMP threads wait; a user who set any keeps all of theirs.
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def divide_cores(num_workers: int, total: int | None = None) -> list[int]:
    """Threads for each of ``num_workers`` torch processes sharing ``total`` cores.

    Cores are split as evenly as possible (the first workers get the remainder); every
    worker gets at least one thread even when workers outnumber cores.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    total = host_cores() if total is None else total
    if total < 1:
        raise ValueError(f"total cores must be >= 1, got {total}")
    base, extra = divmod(total, num_workers)
    return [max(1, base + (1 if i < extra else 0)) for i in range(num_workers)]


def _policy_vars(num_threads: int) -> dict[str, str]:
    n = str(num_threads)
    return {
        "OMP_NUM_THREADS": n,  # libgomp's pool and torch's intra-op default
        "MKL_NUM_THREADS": n,  # MKL's own cap (it would otherwise size for all cores)
        "OMP_WAIT_POLICY": "PASSIVE",  # idle threads sleep instead of spinning
        "KMP_BLOCKTIME": "0",  # the same for wheels built with Intel OpenMP
    }


def thread_env(num_threads: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """The environment for a child process that will run torch with ``num_threads``.

    Returns ``base_env`` plus the policy's variables. A variable already set in
    ``base_env`` wins (users who tuned OMP_NUM_THREADS keep it); a user who set any of
    ``WAIT_VARS`` (e.g. ``GOMP_SPINCOUNT`` for a dedicated host) gets none of ours.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    env = dict(base_env)
    user_wait = any(k in env for k in WAIT_VARS)
    for key, value in _policy_vars(num_threads).items():
        if key in WAIT_VARS and user_wait:
            continue
        env.setdefault(key, value)
    return env


def early_env(num_threads: int | None) -> None:
    """Put the policy into this process's environment before torch is imported.

    No effect on the wait policy if torch is already imported (the OpenMP runtime has
    read it); the thread count is still applied by ``apply_thread_policy``.
    """
    n = num_threads or _env_threads() or host_cores()
    if "torch" in sys.modules:
        logger.debug("torch already imported: OpenMP wait policy stays as it is")
    os.environ.update(thread_env(n, os.environ))


def _env_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def apply_thread_policy(num_threads: int | None, steps: bool = True) -> int:
    """Choose this process's torch threads; returns the intra-op thread count chosen.

    ``num_threads`` None means OMP_NUM_THREADS if the user set it, else every core this
    process may use (one engine per host). Inter-op threads are set to 1: the engine
    issues one op at a time and never forks torch work, so a second pool only idles.
    Also applies the allocator policy (``worker/allocator.py``): every torch process
    comes through here; ``steps`` False (the API process of `triptych serve`, which runs
    no engine steps) keeps glibc's own thresholds.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"cpu_threads must be >= 1, got {num_threads}")
    apply_allocator_policy(steps)  # keep what steps free mapped (worker/allocator.py)
    n = num_threads or _env_threads() or host_cores()
    if "torch" not in sys.modules:
        early_env(n)  # still in time for the OpenMP runtime
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    try:
        if torch.get_num_interop_threads() != 1:
            torch.set_num_interop_threads(1)
    except RuntimeError:  # inter-op pool already started: it can only be sized once
        pass
    return n
