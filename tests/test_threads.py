"""Thread policy: core division, child environments (user settings win), and the policy
applied in a fresh process before torch loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from triptych.worker.threads import divide_cores, thread_env


def test_divide_cores():
    assert divide_cores(1, 2) == [2]
    assert divide_cores(2, 2) == [1, 1]
    assert divide_cores(3, 8) == [3, 3, 2]
    assert divide_cores(3, 2) == [1, 1, 1]  # never zero threads
    assert sum(divide_cores(4, 16)) == 16
    assert len(divide_cores(2)) == 2
    with pytest.raises(ValueError):
        divide_cores(0, 4)


def test_thread_env_sets_policy_and_user_settings_win():
    env = thread_env(3, {"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["KMP_BLOCKTIME"] == "0"
    mine = thread_env(3, {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"})
    assert mine["OMP_NUM_THREADS"] == "7" and mine["OMP_WAIT_POLICY"] == "ACTIVE"
    spin = thread_env(3, {"GOMP_SPINCOUNT": "5000"})  # a tuned wait: none of ours is added
    assert spin["GOMP_SPINCOUNT"] == "5000" and "OMP_WAIT_POLICY" not in spin
    with pytest.raises(ValueError):
        thread_env(0, {})


def test_policy_applied_before_torch_import_in_a_child():
    code = ("import os, json; from triptych.worker.threads import apply_thread_policy;"
            "n = apply_thread_policy(None); import torch;"
            "print(json.dumps([n, torch.get_num_threads(), torch.get_num_interop_threads(),"
            "os.environ.get('OMP_WAIT_POLICY')]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
                        "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", code], env=thread_env(1, env),
                         capture_output=True, text=True, check=True).stdout
    n, intra, inter, wait = json.loads(out.strip().splitlines()[-1])
    assert n == intra == 1 and inter == 1 and wait == "PASSIVE"


def test_cli_reads_cpu_threads_before_parsing():
    from triptych.cli import _early_cpu_threads

    assert _early_cpu_threads(["bench", "throughput", "--cpu-threads", "3"]) == 3
    assert _early_cpu_threads(["serve", "--model", "m", "--cpu-threads=1"]) == 1
    assert _early_cpu_threads(["serve", "--cpu-threads", "x"]) is None  # argparse reports it
    assert _early_cpu_threads(["chat"]) is None


ALLOCATOR_CHILD = """
import json, os
from triptych.worker.threads import apply_thread_policy
apply_thread_policy(1)  # every torch process of ours comes through here
import torch
from triptych.worker import allocator
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
r0 = rss()
ts = [torch.ones(1 << 18) for _ in range(32)]  # 32 x 1 MiB (< the 64 MiB floor), touched
r1 = rss()
del ts
print(json.dumps({"applied": allocator._applied, "kept": (rss() - r0) / (r1 - r0)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt, /proc")
@pytest.mark.parametrize("env,applied", [({}, True),
                                         ({"TRIPTYCH_MALLOC_POLICY": "default"}, False),
                                         ({"MALLOC_TRIM_THRESHOLD_": "0"}, False)])
def test_allocator_policy_keeps_freed_pages_unless_the_user_chose(env, applied):
    """With the policy, memory a step frees stays mapped for the next step (no page faults
    to get it back); a user's own glibc setting, or TRIPTYCH_MALLOC_POLICY=default, wins."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES",
                                                          "TRIPTYCH_MALLOC_POLICY")}
    out = subprocess.run([sys.executable, "-c", ALLOCATOR_CHILD], env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["applied"] is applied
    if applied:
        assert got["kept"] > 0.8  # freed, still mapped: the next step reuses the pages
    else:
        assert got["kept"] < 0.3  # glibc's defaults: 1 MiB blocks go back to the kernel


TRIM_CHILD = """
import json, os
from triptych.worker.threads import apply_thread_policy
apply_thread_policy(1)
import torch
from triptych.worker import allocator
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
trim = allocator.StepTrim()
r0 = rss()
peak = [torch.ones(1 << 18) for _ in range(256)]  # a rare 256 MiB step
del peak
after_peak = rss() - r0
for _ in range(4 * allocator.TRIM_EVERY):  # small steps since
    x = [torch.ones(1 << 18) for _ in range(4)]
    del x
    trim.after_step()
print(json.dumps({"after_peak": after_peak, "end": rss() - r0, "threshold": trim.threshold,
                  "trims": trim.trims, "working_set": trim.working_set,
                  "env": [os.environ.get(v) for v in allocator.ONEDNN_CACHE_VARS]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt, /proc")
def test_allocator_keeps_what_recent_steps_free_not_an_old_peak():
    """A peak far beyond what the steps need is given back after the steps that follow it,
    and the threshold follows what those steps take back (within its floor); oneDNN's
    per-shape caches get a bound unless the user chose one."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in (
                "GLIBC_TUNABLES", "TRIPTYCH_MALLOC_POLICY", "LRU_CACHE_CAPACITY",
                "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], env=base, capture_output=True,
                         check=False, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    assert got["after_peak"] > 200 * mib, got  # freed, not yet returned
    assert got["end"] < 100 * mib, got  # returned once steps ran that need far less
    assert got["trims"] >= 1 and got["threshold"] < 128 * mib, got
    assert got["env"] == ["256", "256"]
