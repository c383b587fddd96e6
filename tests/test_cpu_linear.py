"""CPU linear layers on packed weights (kernels/cpu/linear.py): fp32 the same numbers as
F.linear up to rounding, bf16 / fp16 / int8 weights within their documented error of the
fp32 reference, every linear of a loaded model packed (the LM head through its own copy),
threads chosen by GEMM size and weight bytes, and the choice of a user who turned it off
kept."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from triptych.kernels.cpu import linear as cpu_linear
from triptych.kernels.cpu.linear import (
    FORMATS,
    CpuGemm,
    min_bytes_per_thread,
    min_flops_per_thread,
    pack_linears,
)

sys.path.insert(0, os.path.dirname(__file__))
from cpu_variants import KERNELS  # noqa: F401 (the platform chose this CPU's kernels)

pytestmark = pytest.mark.skipif(not cpu_linear.available(),
                                reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [True, False])
def test_packed_gemm_equals_f_linear(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    gemm = CpuGemm(w, b)
    for shape in [(1, 40), (5, 40), (33, 40), (300, 40), (2, 7, 40)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(gemm(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    wide = torch.randn(16, 80, generator=g)[:, ::2]  # a strided input
    torch.testing.assert_close(gemm(wide), F.linear(wide, w, b), atol=1e-4, rtol=1e-5)


# Relative error (Frobenius norm of y - ref over that of ref) each weight format keeps on
# random weights and inputs; measured ~1e-7, 3e-3, 2e-4 and 1.2e-2 (x rounded to bf16 and
# the bf16 output in the bf16 path; int8 weights per channel, x per tensor in the int8 one).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-3, "int8": 3e-2}


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_weight_format_against_the_fp32_reference(fmt):
    g = torch.Generator().manual_seed(2)
    for k, n, bias in [(40, 96, True), (512, 1024, True), (1376, 512, False)]:
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        gemm = CpuGemm(w, b, fmt)
        assert gemm.weight_bytes == n * k * {"float32": 4, "int8": 1}.get(fmt, 2)
        if fmt in ("float32", "bfloat16"):  # the panels / oneDNN's packed tensor: narrow
            assert (gemm.packed if gemm.panels is None else gemm.panels).dtype == \
                getattr(torch, fmt)
        for shape in [(1, k), (7, k), (33, k), (2, 3, k)]:
            x = torch.randn(*shape, generator=g)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double())
            y = gemm(x)
            assert y.dtype == torch.float32 and y.shape == ref.shape
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < TOLERANCE[fmt], (fmt, k, n, shape, err)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_pack_linears_in_a_narrow_format(fmt):
    torch.manual_seed(3)
    net = _Net().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = net(x)
        assert pack_linears(net, fmt) == 2
        got = net(x)
    assert net.a.cpu_gemm.fmt == fmt and net.a.weight.numel() == 0
    assert ((got - ref).norm() / ref.norm()).item() < 4 * TOLERANCE[fmt]


def test_unknown_weight_format_is_refused():
    with pytest.raises(ValueError, match="CPU weight format must be one of"):
        CpuGemm(torch.randn(4, 4), None, "int4")


def test_threads_follow_the_size_of_the_gemm():
    gemm = CpuGemm(torch.randn(1024, 256), None, min_flops=24e6, min_bytes=2 << 20)
    assert gemm.threads(1, 8) == 1  # a decode row: waking a thread costs more than it saves
    assert gemm.threads(32, 8) == 1  # 16.8 MFLOP
    assert gemm.threads(64, 8) == 1  # 33.5 MFLOP: one thread's worth
    assert gemm.threads(128, 8) == 2
    assert gemm.threads(4096, 8) == 8  # a prefill chunk: every thread
    assert gemm.threads(4096, 2) == 2
    before = torch.get_num_threads()
    gemm(torch.randn(3, 256))  # runs on one thread, then gives the process its threads back
    assert torch.get_num_threads() == before


def test_a_gemv_on_a_big_weight_reads_it_on_every_thread():
    w = torch.randn(4096, 512)  # 8 MiB fp32, 2 MiB int8
    assert CpuGemm(w, None, "float32", min_flops=24e6, min_bytes=2 << 20).threads(1, 2) == 2
    assert CpuGemm(w, None, "float32", min_flops=24e6, min_bytes=2 << 20).threads(1, 8) == 4
    assert CpuGemm(w, None, "int8", min_flops=24e6, min_bytes=4 << 20).threads(1, 2) == 1
    assert min_bytes_per_thread({"OMP_WAIT_POLICY": "PASSIVE"}) == cpu_linear.MIN_BYTES_PASSIVE
    assert min_bytes_per_thread({"OMP_WAIT_POLICY": "ACTIVE"}) == cpu_linear.MIN_BYTES_SPINNING
    assert min_bytes_per_thread({"TRIPTYCH_CPU_GEMM_MIN_BYTES": "1e6"}) == 1e6


def test_min_flops_follows_the_wait_policy():
    assert min_flops_per_thread({"OMP_WAIT_POLICY": "PASSIVE"}) == cpu_linear.MIN_FLOPS_PASSIVE
    # a user who chose spinning threads: wake-ups are cheap, smaller GEMMs go parallel
    assert min_flops_per_thread({"OMP_WAIT_POLICY": "ACTIVE"}) == cpu_linear.MIN_FLOPS_SPINNING
    assert min_flops_per_thread({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "9"}) == \
        cpu_linear.MIN_FLOPS_SPINNING
    assert min_flops_per_thread({"TRIPTYCH_CPU_GEMM_MIN_FLOPS": "5e5"}) == 5e5


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8, bias=False)
        self.lm_head = nn.Linear(8, 30, bias=False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.b(torch.relu(self.a(x)))))


def test_pack_linears_releases_dense_weights_and_keeps_outputs():
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = net(x)
        assert pack_linears(net) == 2  # a and b; the head is skipped by name
        got = net(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert net.a.weight.numel() == 0 and net.a.bias.numel() == 0 and net.b.weight.numel() == 0
    assert net.a.weight.dtype == torch.float32  # code that reads the dtype still works
    assert net.lm_head.weight.shape == (30, 8) and not hasattr(net.lm_head, "cpu_gemm")
    with pytest.raises(RuntimeError):  # a stray F.linear on a packed layer fails loudly
        F.linear(x, net.a.weight)


def test_row_parallel_layer_keeps_its_bias_after_the_reduce():
    from triptych.parallel.context import TPContext
    from triptych.models.parallel_layers import RowParallelLinear

    torch.manual_seed(1)
    one = TPContext(0, 1)
    one.all_reduce = lambda t: t  # the sum over a group of one rank (real groups: TP tests)
    layer = RowParallelLinear(12, 6, bias=True, ctx=one).eval()
    x = torch.randn(3, 12)
    with torch.no_grad():
        ref = layer(x)
        assert pack_linears(layer) == 1
        got = layer(x)
    assert layer.bias.shape == (6,)  # added once, after the all-reduce, as before
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_cpu_gemm_knob_is_checked():
    from triptych.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_gemm must be onednn or torch"):
        EngineConfig(model="m", cpu_gemm="mkl")
    with pytest.raises(ValueError, match="quantization must be int8"):
        EngineConfig(model="m", quantization="awq")
    with pytest.raises(ValueError, match="leave cpu_gemm at onednn"):
        EngineConfig(model="m", quantization="int8", cpu_gemm="torch")


def test_cpu_weight_format_follows_dtype_and_quantization():
    from triptych.config import EngineConfig
    from triptych.engine.sizing.model_shape import resolve_cpu_weights

    cpu = torch.device("cpu")
    assert resolve_cpu_weights(EngineConfig(model="m"), cpu) == "float32"
    assert resolve_cpu_weights(EngineConfig(model="m", dtype="bfloat16"), cpu) == "bfloat16"
    assert resolve_cpu_weights(EngineConfig(model="m", dtype="half"), cpu) == "float16"
    assert resolve_cpu_weights(EngineConfig(model="m", quantization="int8"), cpu) == "int8"
    assert resolve_cpu_weights(EngineConfig(model="m", cpu_gemm="torch"), cpu) is None
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_cpu_weights(EngineConfig(model="m", quantization="int8"), torch.device("meta"))
