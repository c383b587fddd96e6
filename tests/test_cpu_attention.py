"""The fused CPU paged-decode attention (kernels/cpu/paged_attention.py) against the torch
reference, for every block size the config allows and the head layouts the models use, in
every instruction-set copy this CPU runs (AVX-512, AVX2, portable).

The kernel is compiled once per machine (kernels/cpu/build.py); these tests load it from
that cache like the engine does, so the suite compiles it at most once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from triptych.kernels import get_ops, resolve_backend, torch_ref
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import paged_attention as cpu_paged_attention

sys.path.insert(0, os.path.dirname(__file__))
from cpu_variants import ids, runnable

# Only a missing compiler skips: with one, a failed build fails these tests.
pytestmark = pytest.mark.skipif(cpu_build.compiler() is None,
                                reason="no C++ compiler: the fused CPU kernel cannot be built")


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    assert cpu_paged_attention.available(), "the fused CPU kernel did not build (log above)"


def _variants() -> list[int]:
    return runnable(cpu_paged_attention._built())

# (H, Hkv, D): tiny qwen2-vl (16), tiny qwen3-vl / internvl (32), the OCR bench model (64),
# the default bench model (8/4/64), Qwen2-VL-2B (12/2/128), -7B (28/4/128), MHA, MQA
LAYOUTS = [(4, 2, 16), (4, 2, 32), (4, 2, 64), (8, 4, 64), (12, 2, 128), (28, 4, 128),
           (4, 4, 32), (8, 1, 64),
           (4, 2, 80),  # AVX-512 path with a 16-lane tail after the 64-lane chunks
           (4, 2, 40),  # AVX2 path with an 8-lane tail after the 32-lane chunks
           (2, 1, 24),  # not a multiple of 16: AVX-512 takes the portable loop, AVX2 not
           (2, 1, 12)]  # not a multiple of 8: the portable loop everywhere
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # every size EngineConfig accepts


def _case(h: int, hkv: int, d: int, bs: int, lens: list[int], dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q and cache; each sequence's blocks are scattered (shuffled ids) and its
    table row padded past the blocks it uses."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    max_blocks = max(need) + 2
    nb = sum(need) + 3
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    ids = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[used:used + n]
        used += n
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "h{}-kv{}-d{}".format(*x))
def test_matches_the_torch_reference_fp32(bs, layout):
    h, hkv, d = layout
    # lengths: 1, inside one block, a block boundary exactly, a few blocks + a tail
    lens = [1, bs, 3 * bs + 1, 37, 100]
    q, kc, vc, tables, seq_lens = _case(h, hkv, d, bs, lens, torch.float32, seed=bs + d)
    scale = d ** -0.5
    ref = torch_ref.paged_decode_attention(q, kc, vc, tables, seq_lens, scale)
    for v in _variants():
        out = cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, seq_lens, scale,
                                                         variant=v)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, v=v: f"{ids([v])}: {m}")


def test_threads_split_and_plan_give_the_same_result():
    q, kc, vc, tables, lens = _case(8, 4, 64, 16, [200, 5, 77, 130, 1, 64], torch.float32)
    ref = torch_ref.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    plan = cpu_paged_attention.decode_plan(tables, lens, 16)
    assert plan.num_tokens == int(lens.sum())
    for min_bytes in ("1", str(1 << 40)):  # every item its own chunk / all on one thread
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRIPTYCH_CPU_ATTN_MIN_BYTES", min_bytes)
            out = cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, lens, 0.125,
                                                             plan=plan)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert cpu_paged_attention.grain(64, 10 << 20, 2) == 32
    assert cpu_paged_attention.grain(64, 100 << 10, 2) == 64  # too little for a 2nd thread


@pytest.mark.parametrize("d", [64, 40, 12])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_cache_within_rounding_of_the_fp32_math(dtype, d):
    """16-bit q/K/V are widened to fp32 in the loop (vector paths and the portable one);
    the result differs from fp32 math on the same 16-bit inputs only by the final rounding
    to 16 bits."""
    q, kc, vc, tables, lens = _case(4, 2, d, 16, [1, 50, 129], dtype)
    ref = torch_ref.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, lens,
                                           d ** -0.5)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    for v in _variants():
        out = cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5,
                                                         variant=v)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_bad_input_is_refused_clearly():
    q, kc, vc, tables, lens = _case(4, 2, 16, 16, [3], torch.float32)
    with pytest.raises(ValueError, match="must share"):
        cpu_paged_attention.paged_decode_attention(q.double(), kc, vc, tables, lens, 0.25)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_paged_attention.paged_decode_attention(q[:, :3], kc, vc, tables, lens, 0.25)
    empty = cpu_paged_attention.paged_decode_attention(q[:0], kc, vc, tables[:0], lens[:0], 0.25)
    assert empty.shape == (0, 4, 16)


def test_cpu_is_the_cpu_default_and_its_ops_use_the_kernel():
    assert resolve_backend(None, "cpu") == "cpu"
    assert resolve_backend("torch", "cpu") == "torch"
    ops = get_ops("cpu")
    assert ops.paged_decode_attention is cpu_paged_attention.paged_decode_attention
    assert ops.paged_prefill_attention is torch_ref.paged_prefill_attention
    with pytest.raises(ValueError, match="CPU"):
        resolve_backend("cpu", "cuda")


_START = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout);"
          "from triptych.kernels import resolve_backend; print(resolve_backend(None, 'cpu'))")


def test_workers_starting_together_build_once(tmp_path):
    """Two processes on an empty cache at once: one compiles (here a stand-in compiler that
    copies the real library, slowly, and notes which process called it), the other waits
    on the lock and loads the finished file without calling the compiler; both load it."""
    built = cpu_build.load_library(cpu_paged_attention.LIBRARY)
    fake = tmp_path / "fake-g++"
    fake.write_text(f"""#!/bin/sh
[ "$1" = "--version" ] && {{ echo "fake g++ 1"; exit 0; }}
echo $PPID >> {tmp_path}/calls
sleep 1
for a; do out="$a"; done
cp {built} "$out"
""")
    fake.chmod(0o755)
    env = {**os.environ, "CXX": str(fake), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    procs = [subprocess.Popen([sys.executable, "-c", _START], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(out.strip().endswith("cpu") for out in outs), outs
    # probes, the op, a copy per variant and the link: all from one of the two processes
    callers = set((tmp_path / "calls").read_text().split())
    assert len(callers) == 1 and callers <= {str(p.pid) for p in procs}, callers
    assert sum("compiling" in out for out in outs) == 1, outs


def test_no_compiler_falls_back_to_torch_with_a_warning(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run([sys.executable, "-c", _START], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip().endswith("torch")
    assert "no C++ compiler found" in out.stderr + out.stdout and "install g++" in (
        out.stderr + out.stdout)


def test_tables_that_point_outside_the_cache_are_refused():
    q, kc, vc, tables, lens = _case(4, 2, 16, 16, [20], torch.float32)
    bad = tables.clone()
    bad[0, 1] = kc.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_paged_attention.paged_decode_attention(q, kc, vc, bad, lens, 0.25)
    too_long = torch.tensor([tables.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_paged_attention.paged_decode_attention(q, kc, vc, tables, too_long, 0.25)
