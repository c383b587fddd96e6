"""The batch-1 GEMV kernel (kernels/cpu/gemv.py, csrc/cpu_gemv.cpp) behind ``CpuGemm`` for
calls of 1-2 rows: fp32 / bf16 / int8 within their error of an fp64 reference (fp32 equal
to F.linear up to rounding; fp16 stays on fbgemm), K not a multiple of the 16-lane vector, bias and per-row
scales, a row split over threads equal to one thread's, the library path for more rows,
and ``TRIPTYCH_CPU_GEMV=0`` turning it off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triptych.kernels.cpu import gemv as cpu_gemv
from triptych.kernels.cpu import linear as cpu_linear
from triptych.kernels.cpu.linear import FORMATS, GEMV_MAX_ROWS, CpuGemm

pytestmark = pytest.mark.skipif(not (cpu_linear.available() and cpu_gemv.enabled()),
                                reason="no packed CPU linear or no C++ compiler here")

# relative error vs fp64: the weight's own rounding (int8: x too, to 8 bits per row, on VNNI CPUs)
TOLERANCE = {"float32": 1e-6, "bfloat16": 5e-3, "float16": 1e-3, "int8": 1.5e-2}


@pytest.mark.parametrize("fmt", [f for f in FORMATS if GEMV_MAX_ROWS[f]])
def test_gemv_rows_match_the_reference_in_every_format(fmt, monkeypatch):
    # fp32 takes the GEMV only where the panel GEMM does not run (no AVX-512, or switched off)
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
    if gemm.panels is None:
        pytest.skip("no AVX-512 panel GEMM on this CPU")
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
    y = gemm(torch.randn(1, 32))  # the library's bf16 path
    assert y.shape == (1, 16) and y.dtype == torch.float32
