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


@pytest.mark.parametrize("variant", VARIANTS, ids=ids(VARIANTS))
def test_draw_equals_the_samplers_torch_draw(variant):
    """The sampler's one-call draw of plain random rows (engine: CPU steps whose random rows
    ask a temperature only) picks the token the torch ops pick at the same uniform: the
    inverse CDF of softmax(logits / T). A masked (-inf) token is never drawn, even at a
    uniform that lands on it; a row with a NaN, a +inf or nothing but -inf keeps the id
    it had (the argmax); only the listed rows change."""
    from triptych.engine.sample.sampler import Sampler, SamplingTensors

    g = torch.Generator().manual_seed(5)
    sampler = Sampler()
    for s_rows, v in [(1, 272), (6, 272), (3, 17), (2, 1), (4, 1000)]:
        logits = torch.randn(s_rows, v, generator=g) * 3
        rows = torch.arange(s_rows - 1, -1, -2)  # every other row, last first
        temp = torch.rand(len(rows), generator=g) + 0.3
        for _ in range(20):
            u = torch.rand(len(rows), generator=g, dtype=torch.float64)
            st = SamplingTensors(greedy=False, random_rows=rows, temperature=temp)
            sampler._uniforms = lambda st_, dev, u=u: u[:, None].clone()
            want = sampler._draw(logits[rows], st)
            ids = torch.full((s_rows,), -7, dtype=torch.long)
            got = cpu_panel_gemm.draw(logits, rows, temp, u, ids, variant)
            assert torch.equal(got[rows], want), (s_rows, v, got, want)
            others = torch.ones(s_rows, dtype=torch.bool)
            others[rows] = False
            assert (got[others] == -7).all()
    masked = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]])
    one = torch.tensor([0])
    for u in (0.0, 0.4999, 0.5, 0.9999999):
        got = cpu_panel_gemm.draw(masked, one, torch.tensor([1.0]),
                                  torch.tensor([u], dtype=torch.float64),
                                  torch.tensor([9]), variant)
        assert int(got[0]) == (0 if u < 0.5 else 2), u
    for bad in (float("nan"), float("inf")):
        row = torch.tensor([[0.0, bad, 1.0]])
        got = cpu_panel_gemm.draw(row, one, torch.tensor([1.0]),
                                  torch.tensor([0.3], dtype=torch.float64),
                                  torch.tensor([1]), variant)
        assert int(got[0]) == 1
    gone = torch.full((1, 5), float("-inf"))
    assert int(cpu_panel_gemm.draw(gone, one, torch.tensor([1.0]),
                                   torch.tensor([0.3], dtype=torch.float64),
                                   torch.tensor([4]), variant)[0]) == 4


def test_the_cpu_sampler_draws_with_it_as_with_torch():
    """``Sampler`` with the platform's draw (as the CPU runner builds it): seeded requests
    draw the same tokens as with torch's ops and whatever their batch-mates; the draws
    follow the distribution; rows asking top-k keep the torch path (the draw is not
    asked)."""
    from triptych.engine.device.platform import cpu_draw
    from triptych.engine.sample.sampler import Sampler
    from triptych.engine.sample.sampling_params import SamplingParams

    calls = []

    def counting(*a):
        calls.append(1)
        return cpu_draw(*a)

    logits = torch.randn(1, 272, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=0.8, seed=1234)
    plain = Sampler(seed=4)
    fast = Sampler(seed=9, draw=counting)
    mate = SamplingParams(temperature=1.0)
    a = [plain(logits, ["x"], [sp]).token_ids[0] for _ in range(30)]
    b = [fast(torch.cat([torch.randn(1, 272), logits]), ["y", "x"], [mate, sp]).token_ids[1]
         for _ in range(30)]
    assert a == b and len(set(a)) > 3 and len(calls) == 30
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ids = fast(torch.log(p).repeat(2000, 1), [f"r{i}" for i in range(2000)],
               [SamplingParams(temperature=1.0)] * 2000).token_ids  # (past the C++ size:
    counts = torch.bincount(torch.tensor(ids), minlength=4).double()  # torch's; and below)
    chi2 = float(((counts - 2000 * p.double()) ** 2 / (2000 * p.double())).sum())
    assert chi2 < 16.27, counts.tolist()
    small = [fast(torch.log(p)[None], ["s"], [SamplingParams(temperature=1.0)]).token_ids[0]
             for _ in range(2000)]
    counts = torch.bincount(torch.tensor(small), minlength=4).double()
    chi2 = float(((counts - 2000 * p.double()) ** 2 / (2000 * p.double())).sum())
    assert chi2 < 16.27, counts.tolist()
    n = len(calls)
    fast(logits, ["k"], [SamplingParams(temperature=1.0, top_k=3)])
    assert len(calls) == n
