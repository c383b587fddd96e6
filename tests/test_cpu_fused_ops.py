"""The CPU decoder layer's fused ops (kernels/cpu/fused_ops.py, csrc/cpu_fused_ops/)
against the torch reference they replace in the ``cpu`` backend, in every instruction-set
copy this CPU runs: M-RoPE of strided q / k views and the K/V cache write (padding slots
skipped) bit for bit, residual + RMSNorm within the rounding of its mean, silu(gate) * up
within a few ulp of its exp (overflow, underflow and NaN as torch), the fallbacks for
inputs the C++ ops do not take, and ``TRIPTYCH_CPU_FUSED_OPS=0`` keeping the torch ops in
``get_ops('cpu')``."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from triptych.kernels import get_ops, torch_ref
from triptych.kernels.cpu import fused_ops as cpu_fused_ops

sys.path.insert(0, os.path.dirname(__file__))
from cpu_variants import ids, runnable

pytestmark = pytest.mark.skipif(not cpu_fused_ops.enabled(), reason="no C++ compiler here")
VARIANTS = runnable(cpu_fused_ops._built()) if cpu_fused_ops.enabled() else []


@pytest.fixture(params=VARIANTS, ids=ids(VARIANTS))
def variant(request, monkeypatch) -> int:
    """The ops run this copy (the engine runs the platform's choice)."""
    monkeypatch.setattr(cpu_fused_ops, "variant_id", lambda: request.param)
    return request.param


def test_add_rms_norm_matches_the_reference(variant):
    g = torch.Generator().manual_seed(0)
    for t, c in [(1, 512), (5, 40), (3, 17)]:
        x, r, w = torch.randn(t, c, generator=g), torch.randn(t, c, generator=g), \
            torch.randn(c, generator=g)
        y, total = cpu_fused_ops.rms_norm(x, w, 1e-6, r)
        y_ref, total_ref = torch_ref.rms_norm(x, w, 1e-6, r)
        assert torch.equal(total, total_ref)  # the add is the same fp32 op
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cpu_fused_ops.rms_norm(x, w, 1e-6),
                                   torch_ref.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 8, generator=g)  # 3-D: the reference's path
    assert torch.equal(cpu_fused_ops.rms_norm(x3, torch.ones(8), 1e-6),
                       torch_ref.rms_norm(x3, torch.ones(8), 1e-6))


def test_mrope_and_cache_write_equal_the_reference_bit_for_bit(variant):
    g = torch.Generator().manual_seed(1)
    t, h, hkv, d = 7, 8, 4, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)  # q / k / v: strided views
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    pos = torch.randint(0, 100, (3, t), generator=g)
    table = torch.randn(128, d, generator=g)
    plan = torch_ref.mrope_plan(pos, table, [8, 12, 12])
    for extra in ({}, {"plan": plan}):
        got = cpu_fused_ops.apply_mrope(q, k, pos, table, [8, 12, 12], **extra)
        ref = torch_ref.apply_mrope(q, k, pos, table, [8, 12, 12], **extra)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    caches = [torch.zeros(4, 16, hkv, d) for _ in range(4)]
    slots = torch.tensor([3, 17, -1, 40, 63, 0, 5])
    cpu_fused_ops.reshape_and_cache(k, v, caches[0], caches[1], slots)
    torch_ref.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
    bf = [torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16) for _ in range(2)]
    cpu_fused_ops.reshape_and_cache(k, v, bf[0], bf[1], slots)  # fp32 -> bf16: reference
    assert torch.equal(bf[0].view(-1, hkv, d)[3], k[0].bfloat16())


def test_silu_and_mul_matches_torch_within_a_few_ulp(variant):
    # NOTE: measured max difference from F.silu(gate) * up: 3.1e-7 relative (~2.6 ulp;
    # 96% of the elements equal), from the two exps' roundings (torch's and ours)
    g = torch.Generator().manual_seed(2)
    for t, inter, scale in [(1, 1376, 1.0), (32, 1376, 4.0), (3, 43, 20.0), (5, 16, 1.0)]:
        gu = torch.randn(t, 2 * inter, generator=g) * scale
        got = cpu_fused_ops.silu_and_mul(gu, inter)
        assert got.shape == (t, inter) and got.is_contiguous()
        torch.testing.assert_close(got, torch_ref.silu_and_mul(gu, inter), rtol=5e-7, atol=0)
    wide = torch.randn(4, 3 * 43, generator=g)[:, 10:10 + 86]  # strided rows of a wider buffer
    torch.testing.assert_close(cpu_fused_ops.silu_and_mul(wide, 43),
                               torch_ref.silu_and_mul(wide, 43), rtol=5e-7, atol=0)
    edge = torch.tensor([[float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 95.0, -95.0,
                          -87.0, 1e-30] + [1.0] * 9])  # overflow, underflow, NaN: as torch
    torch.testing.assert_close(cpu_fused_ops.silu_and_mul(edge, 9),
                               torch_ref.silu_and_mul(edge, 9), rtol=5e-7, atol=0,
                               equal_nan=True)
    cols = torch.randn(2 * 43, 3, generator=g).t()  # non-unit column stride: the reference
    assert torch.equal(cpu_fused_ops.silu_and_mul(cols, 43), torch_ref.silu_and_mul(cols, 43))
    with pytest.raises(ValueError, match="2 \\* inter"):
        cpu_fused_ops.silu_and_mul(torch.randn(2, 10), 4)


def test_the_cpu_backend_takes_the_fused_ops_unless_switched_off(monkeypatch):
    assert get_ops("cpu").apply_mrope is cpu_fused_ops.apply_mrope
    assert get_ops("cpu").silu_and_mul is cpu_fused_ops.silu_and_mul
    assert get_ops("torch").rms_norm is torch_ref.rms_norm
    assert get_ops("torch").silu_and_mul is torch_ref.silu_and_mul
    monkeypatch.setenv("TRIPTYCH_CPU_FUSED_OPS", "0")
    ops = get_ops("cpu")
    assert ops.rms_norm is torch_ref.rms_norm and ops.reshape_and_cache is torch_ref.reshape_and_cache
    assert ops.silu_and_mul is torch_ref.silu_and_mul
