"""The batch-1 GEMV kernel (kernels/cpu/gemv.py, csrc/cpu_gemv/) behind ``CpuGemm`` for
calls of 1-2 rows, in every instruction-set copy this CPU runs: fp32 / bf16 / fp16 / int8
within their error of an fp64 reference (fp32 equal to F.linear up to rounding), int8 equal
bit for bit across the copies (VNNI, AVX2's vpmaddubsw, the portable loop: the same integer
sums), K not a multiple of any vector, bias and per-row scales, a row split over threads
equal to one thread's, the library path for more rows, and ``TRIPTYCH_CPU_GEMV=0`` turning
it off."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from triptych.kernels.cpu import gemv as cpu_gemv
from triptych.kernels.cpu import linear as cpu_linear
from triptych.kernels.cpu.linear import FORMATS, GEMV_MAX_ROWS, CpuGemm

sys.path.insert(0, os.path.dirname(__file__))
from cpu_variants import KERNELS, ids, runnable

pytestmark = pytest.mark.skipif(not (cpu_linear.available() and cpu_gemv.enabled()),
                                reason="no packed CPU linear or no C++ compiler here")

# relative error vs fp64: the weight's own rounding (int8: x too, to 8 bits per row)
TOLERANCE = {"float32": 1e-6, "bfloat16": 5e-3, "float16": 1e-3, "int8": 1.5e-2}
VARIANTS = runnable(cpu_gemv._built()) if cpu_gemv.enabled() else []


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def test_every_copy_matches_the_reference_and_int8_is_the_same_bits_in_each():
    """Each copy this CPU runs, called directly in every format (fp16 too: the kernel has
    it, though CpuGemm leaves fp16 to fbgemm)."""
    g = torch.Generator().manual_seed(3)
    for k, n in [(40, 96), (7, 33), (512, 1024), (1376, 200), (33, 5), (100, 9)]:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        wq, scale = _int8(w)
        for m in (1, 2):
            x = torch.randn(m, k, generator=g)
            ref = F.linear(x.double(), w.double(), b.double())
            int8 = []
            for v in VARIANTS:
                for fmt, weight in (("float32", w), ("bfloat16", w.bfloat16()),
                                    ("float16", w.half()), ("int8", wq)):
                    if fmt == "int8":
                        y = cpu_gemv.gemv(x, wq, scale, b, 2, cpu_gemv.row_sums(wq), v)
                        int8.append(y)
                    else:
                        y = cpu_gemv.gemv(x, weight, None, b, 2, None, v)
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    assert err < TOLERANCE[fmt], (ids([v]), fmt, k, n, m, err)
            assert all(torch.equal(y, int8[0]) for y in int8), (k, n, m)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if GEMV_MAX_ROWS[f]])
def test_gemv_rows_match_the_reference_in_every_format(fmt, monkeypatch):
    # fp32 and bf16 take the GEMV where the panels do not take their rows (fp32: the panels
    # switched off; bf16: always)
    monkeypatch.setenv("TRIPTYCH_CPU_PANEL_GEMM", "0")
    g = torch.Generator().manual_seed(0)
    for k, n, bias in [(40, 96, True), (7, 33, False), (512, 1024, True), (1376, 200, False)]:
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        gemm = CpuGemm(w, b, fmt)
        assert gemm.gemv_max_rows == GEMV_MAX_ROWS[fmt] and gemm.gemv_w.dtype == {
            "int8": torch.int8}.get(fmt, getattr(torch, fmt, None))
        for shape in [(1, k), (1, 1, k), (GEMV_MAX_ROWS[fmt], k)]:
            x = torch.randn(*shape, generator=g)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            y = gemm(x)
            assert y.dtype == torch.float32 and y.shape == ref.shape
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < TOLERANCE[fmt], (fmt, k, n, shape, err)
    if fmt == "float32":  # the fp32 GEMV reads the caller's weight: no copy
        assert gemm.gemv_bytes == 0 and gemm.gemv_w.data_ptr() == w.data_ptr()
    else:
        assert gemm.gemv_bytes == gemm.weight_bytes


def test_fp32_takes_the_panels_at_one_row_where_they_run():
    w = torch.randn(96, 40)
    gemm = CpuGemm(w, None, "float32")
    if (("float32", KERNELS.variant) not in cpu_linear.PANELS_AT_ONE_ROW
            or KERNELS.batched["float32"] != "panels"):
        pytest.skip(f"fp32 takes the GEMV at 1-2 rows on this CPU ({KERNELS.variant})")
    assert gemm.gemv_max_rows == 0 and gemm.gemv_w is None
    x = torch.randn(1, 40)
    torch.testing.assert_close(gemm(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_fp16_stays_on_fbgemm_without_a_copy():
    gemm = CpuGemm(torch.randn(64, 32), None, "float16")
    assert gemm.gemv_max_rows == 0 and gemm.gemv_w is None and gemm.gemv_bytes == 0


def test_gemv_threads_split_rows_without_changing_them():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3001, 48, generator=g).half()  # the kernel's fp16 path, called directly
    x = torch.randn(2, 48, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = cpu_gemv.gemv(x, w, None, None, 1)
        two = cpu_gemv.gemv(x, w, None, None, 2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output row is one thread's dot product either way
    torch.testing.assert_close(one, F.linear(x, w.float()), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="int8 weights need their per-row scale"):
        cpu_gemv.gemv(x, w.to(torch.int8), None, None, 1)


def test_strided_row_and_library_path_above_the_gemv_rows():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 40, generator=g)
    gemm = CpuGemm(w, None)
    strided = torch.randn(1, 80, generator=g)[:, ::2]
    torch.testing.assert_close(gemm(strided), F.linear(strided, w), atol=1e-4, rtol=1e-5)
    x = torch.randn(GEMV_MAX_ROWS["float32"] + 1, 40, generator=g)
    torch.testing.assert_close(gemm(x), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_env_switch_turns_the_gemv_off(monkeypatch):
    monkeypatch.setenv("TRIPTYCH_CPU_GEMV", "0")
    gemm = CpuGemm(torch.randn(16, 32), None, "bfloat16")
    assert gemm.gemv_max_rows == 0 and gemm.gemv_w is None and gemm.gemv_bytes == 0
    y = gemm(torch.randn(1, 32))  # oneDNN's bf16 path (the panels where that does not run)
    assert y.shape == (1, 16) and y.dtype == torch.float32
