"""Every benchmark: `triptych bench` (throughput, serve, layouts, multiturn, cpu-decode) and
the kernel / connector / TP / CPU-linear scripts (`python -m triptych.bench.kernels`)."""
from __future__ import annotations

import os
from typing import Any


def machine() -> dict[str, Any]:
    """The box a benchmark ran on, recorded beside its figures: the CPU and the flags the
    engine chose by (engine/device/cpu_features.py; under TRIPTYCH_CPU_ISA, what it hid)."""
    import torch
    from triptych.engine.device import cpu_features

    cpu = cpu_features.detect()
    return {"cpu": cpu.model, "cpu_flags": cpu.summary(), "cores": os.cpu_count(),
            "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "omp_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                   "GOMP_SPINCOUNT") if k in os.environ}}

