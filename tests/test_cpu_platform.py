"""The platform seam's CPU choices (engine/device/cpu_features.py,
engine/device/platform.cpu_kernels) and the switch that makes an AVX-512 box choose as an
AVX2-only one (``TRIPTYCH_CPU_ISA``):

- each level hides the flags it names and nothing else; a bad value is refused naming the
  variable; the libraries' own caps are exported unless the user set them;
- in a process started under ``avx2``, ATen dispatches AVX2, oneDNN's bf16 path refuses as
  on an AVX2-only CPU, the engine runs the avx2 copy of the C++ kernels and bf16 weights on
  the panel GEMM (within bf16's error), int8 with 7-bit activations;
- a library holds every variant its compiler takes (a compiler without AVX-512 flags builds
  generic + avx2, and this CPU then runs the avx2 copy);
- bf16 with neither oneDNN's bf16 GEMM nor the C++ kernels is refused in one line naming
  the flag and the formats that run; fp32 still runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from triptych.engine.device import cpu_features
from triptych.engine.device.platform import cpu_kernels
from triptych.kernels.cpu import isa

ZEN5 = {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
        "avx512cd", "avx512_bf16", "avx512_vnni", "avx512vbmi", "avx_vnni"}
SPR = ZEN5 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
CPU = cpu_features.detect()
HAS_AVX2 = CPU.has(*isa.VARIANTS["avx2"][1]) or "avx2" in CPU.hidden


def _run(code: str, **env: str) -> dict:
    """``code`` in a fresh Python (the switch acts before torch's first op) printing JSON."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                          "FBGEMM_ENABLE_INSTRUCTIONS", "MKL_ENABLE_INSTRUCTIONS",
                          "TRIPTYCH_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=False,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_level_hides_what_it_names():
    native = cpu_features.features("x", SPR, "native")
    assert native.flags == SPR and not native.hidden
    assert isa.best_variant(native.flags) == "avx512_bf16"
    sky = cpu_features.features("x", SPR, "avx512")
    assert sky.has("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512vbmi")
    assert not sky.flags & {"avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "avx512_fp16"}
    assert isa.best_variant(sky.flags) == "avx512"
    two = cpu_features.features("x", SPR, "avx2")
    assert two.flags == {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert two.hidden == SPR - two.flags and isa.best_variant(two.flags) == "avx2"
    assert "TRIPTYCH_CPU_ISA=avx2: hides avx512f" in two.summary()
    assert isa.best_variant({"sse4_2", "avx"}) == "generic"
    assert isa.best_variant({"avx2", "fma"}) == "generic"  # no F16C: not the avx2 copy


def test_the_switch_is_checked_and_the_users_own_caps_win():
    assert cpu_features.level({"TRIPTYCH_CPU_ISA": " AVX2 "}) == "avx2"
    assert cpu_features.level({}) == "native"
    with pytest.raises(ValueError, match="TRIPTYCH_CPU_ISA='avx3': use one of native"):
        cpu_features.level({"TRIPTYCH_CPU_ISA": "avx3"})
    env = {"TRIPTYCH_CPU_ISA": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512"}
    cpu_features.apply_switch(env)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["FBGEMM_ENABLE_INSTRUCTIONS"] == "AVX512"  # the user's
    untouched = {"TRIPTYCH_CPU_ISA": "native"}
    cpu_features.apply_switch(untouched)
    assert untouched == {"TRIPTYCH_CPU_ISA": "native"}


PROBE = """
import json, torch, triptych
from triptych.engine.device.platform import cpu_kernels
from triptych.kernels.cpu.linear import CpuGemm
k = cpu_kernels()
g = torch.Generator().manual_seed(0)
w, x = torch.randn(64, 48, generator=g), torch.randn(5, 48, generator=g)
gemm = CpuGemm(w, None, "bfloat16")
ref = x @ w.T
try:
    torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32)
    onednn = "ran"
except RuntimeError as e:
    onednn = str(e)
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "variant": k.variant,
                  "batched": k.batched, "vnni": k.int8_vnni, "panels": gemm.panels is not None,
                  "err": ((gemm(x) - ref).norm() / ref.norm()).item(), "onednn": onednn}))
"""


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2/FMA/F16C: nothing to force")
def test_a_process_under_the_avx2_switch_runs_as_an_avx2_only_cpu():
    got = _run(PROBE, TRIPTYCH_CPU_ISA="avx2")
    assert got["aten"] == "AVX2" and got["variant"] == "avx2" and not got["vnni"]
    assert got["batched"] == {"float32": "panels", "bfloat16": "panels", "float16": "fbgemm",
                              "int8": "fbgemm"}
    assert "bf16 path needs" in got["onednn"]  # oneDNN refuses bf16 weights, as on AVX2 CPUs
    assert got["panels"] and got["err"] < 1e-2  # ... and the engine's bf16 runs regardless


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_a_library_holds_every_variant_its_compiler_takes(tmp_path):
    """A compiler that refuses the AVX-512 flags: the library is built with the others,
    says so, and this CPU runs the best copy the library has."""
    cxx = tmp_path / "g++-no-avx512"
    cxx.write_text('#!/bin/sh\nfor a; do [ "$a" = -mavx512f ] && { echo "unknown -mavx512f" >&2; '
                   'exit 1; }; done\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    got = _run("""
import json, torch, triptych
from triptych.engine.device.platform import cpu_kernels
from triptych.kernels.cpu import gemv
k = cpu_kernels()
assert gemv.enabled()
x, w = torch.randn(2, 40), torch.randn(30, 40)
y = gemv.gemv(x, w, None, None, 1)
print(json.dumps({"built": list(gemv._built()), "runs": gemv.variant_id(),
                  "err": (y - x @ w.T).abs().max().item()}))
""", CXX=str(cxx), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert got["built"] == [0, 1] and got["err"] < 1e-4
    assert got["runs"] == (1 if cpu_kernels().variant_id >= 1 else 0)


REFUSE = """
import json, torch, triptych
from triptych.config import EngineConfig
from triptych.engine.device.platform import resolve_cpu_weights
cpu = torch.device("cpu")
out = {"fp32": resolve_cpu_weights(EngineConfig(model="m"), cpu)}
try:
    out["bf16"] = resolve_cpu_weights(EngineConfig(model="m", dtype="bfloat16"), cpu)
except ValueError as e:
    out["bf16"] = "refused: " + str(e)
print(json.dumps(out))
"""


def test_bf16_with_nothing_that_runs_it_well_is_refused_in_one_line(tmp_path):
    nowhere = {"CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    got = _run(REFUSE, TRIPTYCH_CPU_ISA="avx2", **nowhere)
    assert got["fp32"] == "float32"
    assert got["bf16"].startswith("refused: --dtype bfloat16 does not run well on this CPU "
                                  "(oneDNN's bf16 GEMM needs avx512bw/vl/dq")
    assert got["bf16"].endswith("formats that do: --dtype float32, --dtype float16, "
                                "--quantization int8") and "\n" not in got["bf16"]
    if cpu_kernels().batched["bfloat16"] == "onednn":  # oneDNN's bf16 needs no compiler
        assert _run(REFUSE, **nowhere)["bf16"] == "bfloat16"
