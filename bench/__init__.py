"""Every benchmark: `triptych bench` (throughput, serve, layouts, multiturn, cpu-decode) and
the kernel / connector / TP / CPU-linear scripts (`python -m triptych.bench.kernels`)."""
from __future__ import annotations

import os
from typing import Any


def machine() -> dict[str, Any]:
    """The box a benchmark ran on, recorded beside its figures."""
    import torch
    cpu = "?"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "omp_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                   "GOMP_SPINCOUNT") if k in os.environ}}

