"""The batched panel GEMM (kernels/cpu/panel_gemm.py, csrc/cpu_panel_gemm/) behind
``CpuGemm`` where the platform chose panels (fp32 wherever AVX2 runs, bf16 where oneDNN's
bf16 GEMM does not), and the sampler's C++ argmax, in every instruction-set copy this CPU
runs: fp32 / bf16 within their rounding of an fp64 reference for row counts around the
8-row (AVX-512) and 6-row (AVX2) register tiles and column counts around the 48- and
16-column ones (odd K, bias), a split over 2 threads equal to one thread's,
``TRIPTYCH_CPU_PANEL_GEMM=0`` keeping oneDNN, and argmax equal to torch.argmax (ties: the
first; NaN wins)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from triptych.engine.device.platform import cpu_argmax
from triptych.kernels.cpu import panel_gemm as cpu_panel_gemm
from triptych.kernels.cpu.linear import CpuGemm

sys.path.insert(0, os.path.dirname(__file__))
from cpu_variants import KERNELS, ids, runnable

pytestmark = pytest.mark.skipif(not cpu_panel_gemm.loaded(), reason="no C++ compiler here")
# bf16: x and w rounded to bf16 (avx512_bf16's pair dot products); w only in the others
TOLERANCE = {"float32": 1e-6, "bfloat16": 5e-3}
VARIANTS = runnable(cpu_panel_gemm._built()) if cpu_panel_gemm.loaded() else []


@pytest.mark.parametrize("variant", VARIANTS, ids=ids(VARIANTS))
@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_panel_gemm_matches_the_reference(fmt, variant):
    g = torch.Generator().manual_seed(0)
    for k, n, bias in [(40, 96, True), (33, 50, False), (512, 1040, True), (1377, 17, False)]:
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        panels = cpu_panel_gemm.pack(w.to(getattr(torch, fmt)))
        for m in (1, 2, 3, 5, 6, 7, 8, 9, 32, 37):
            x = torch.randn(m, k, generator=g)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            y = cpu_panel_gemm.gemm(x, panels, n, b, 1, variant)
            assert y.dtype == torch.float32 and y.shape == ref.shape
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < TOLERANCE[fmt], (fmt, k, n, m, err)
            if m == 32:  # columns split over 2 threads: the same sums, bit for bit
                torch.set_num_threads(2)
                try:
                    assert torch.equal(cpu_panel_gemm.gemm(x, panels, n, b, 2, variant), y)
                finally:
                    torch.set_num_threads(1)


def test_cpu_gemm_takes_the_panels_the_platform_chose_and_the_switch_turns_fp32_off(
        monkeypatch):
    if KERNELS.batched["float32"] != "panels":
        pytest.skip(f"no AVX2 here ({KERNELS.variant}): fp32 stays on oneDNN")
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(300, 64, generator=g), torch.randn(300, generator=g), \
        torch.randn(2, 16, 64, generator=g)
    gemm = CpuGemm(w, b, "float32")
    assert gemm.panels is not None and gemm.packed is None
    y = gemm(x)
    assert torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    half = CpuGemm(w, b, "bfloat16")
    # bf16: oneDNN where its bf16 GEMM runs (AVX-512), else our panels, switch or not
    assert (half.panels is None) == (KERNELS.batched["bfloat16"] == "onednn")
    monkeypatch.setenv("TRIPTYCH_CPU_PANEL_GEMM", "0")
    lib = CpuGemm(w, b, "float32")
    assert lib.panels is None and lib.packed is not None
    assert torch.allclose(lib(x), y, rtol=1e-5, atol=1e-5)
    assert (CpuGemm(w, b, "bfloat16").panels is None) == (half.panels is None)
    err = ((half(x) - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm()).item()
    assert err < 1e-2


@pytest.mark.parametrize("variant", VARIANTS, ids=ids(VARIANTS))
def test_argmax_equals_torch_with_ties_and_nan(variant):
    g = torch.Generator().manual_seed(2)
    for m, v in [(1, 1), (3, 17), (32, 151936), (5, 100), (2, 9)]:
        logits = torch.randn(m, v, generator=g)
        if v >= 17:
            logits[0, 3] = logits[0, 9] = 1e9  # tie: the first index
            logits[-1, v - 1] = 1e9  # the maximum in the tail after the vector loop
        if m >= 3:
            logits[1, 5] = float("nan")  # torch.argmax: NaN is the largest
        assert torch.equal(cpu_panel_gemm.argmax(logits, variant), logits.argmax(-1)), (m, v)
    logits = torch.randn(4, 1000, generator=g)
    assert torch.equal(cpu_argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS, ids=ids(VARIANTS))
def test_gemm_argmax_equals_the_argmax_of_the_gemm(variant):
    """The LM head's greedy tokens without its logits (engine: plain-greedy CPU steps) equal
    argmax(gemm) for every split over threads, with a bias, ties, a NaN and -inf rows."""
    g = torch.Generator().manual_seed(3)
    for m, k, n in [(1, 64, 1000), (3, 40, 97), (9, 33, 5), (32, 512, 20000)]:
        w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), \
            torch.randn(m, k, generator=g)
        panels = cpu_panel_gemm.pack(w)
        for bias in (None, b):
            ref = cpu_panel_gemm.gemm(x, panels, n, bias, 1, variant).argmax(-1)
            for threads in (1, 2, 3):
                got = cpu_panel_gemm.gemm_argmax(x, panels, n, bias, threads, variant)
                assert torch.equal(got, ref), (m, k, n, threads)
    w = torch.zeros(200, 8)
    w[30] = w[150] = 1.0  # a tie across two chunks of columns: the first wins
    x = torch.ones(3, 8)
    x[2] = float("-inf")  # every output -inf (or NaN): torch's first index / NaN rules
    panels = cpu_panel_gemm.pack(w)
    assert torch.equal(cpu_panel_gemm.gemm_argmax(x, panels, 200, None, 3, variant),
                       (x @ w.T).argmax(-1))
    w[170, 0] = float("nan")
    panels = cpu_panel_gemm.pack(w)
    assert torch.equal(cpu_panel_gemm.gemm_argmax(x[:2], panels, 200, None, 3, variant),
                       (x[:2] @ w.T).argmax(-1))


def test_cpu_gemm_argmax_is_the_argmax_of_its_output():
    if KERNELS.batched["float32"] != "panels":
        pytest.skip(f"no AVX2 here ({KERNELS.variant}): fp32 stays on oneDNN")
    g = torch.Generator().manual_seed(4)
    gemm = CpuGemm(torch.randn(500, 64, generator=g), None, "float32")
    h = torch.randn(4, 64, generator=g)
    assert torch.equal(gemm.argmax(h), gemm(h).argmax(-1))
