"""Compile every Triton kernel for a CUDA target without a GPU (Triton's own ptxas).

    python -m triptych.kernels.triton.compile_check --arch 90 --dtypes bf16,fp16,fp32

Catches what the CPU interpreter cannot: layout and dot-shape constraints, dtype rules,
register/shared-memory limits of the real backend. Must run without TRITON_INTERPRET
(the interpreter replaces the kernels with Python functions).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# Per kernel: the constexpr values of one typical launch (7B-like: 32 heads, 8 KV heads,
# head_dim 128, block 16). Pointer and scalar types are derived from argument names.
_LAUNCHES = {
    "triptych.kernels.triton.cache:_reshape_and_cache_kernel": dict(ROW=1024, BLOCK=1024),
    "triptych.kernels.triton.decode_attention:_decode_split_kernel": dict(
        G=4, BLOCK_H=16, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, ONE_SPLIT=False,
        UPCAST=None, PART_IN_MEMORY=False),
    "triptych.kernels.triton.decode_attention:_decode_reduce_kernel": dict(
        D=128, D_PAD=128, S_BLOCK=16, PART_IN_MEMORY=False),
    # the CUDA-graph launch: the partition read from device memory (#: a second variant)
    "triptych.kernels.triton.decode_attention:_decode_split_kernel#graph": dict(
        G=6, BLOCK_H=16, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, ONE_SPLIT=False,
        UPCAST=None, PART_IN_MEMORY=True),
    "triptych.kernels.triton.decode_attention:_decode_reduce_kernel#graph": dict(
        D=128, D_PAD=128, S_BLOCK=16, PART_IN_MEMORY=True),
    "triptych.kernels.triton.prefill_attention:_prefill_kernel": dict(
        G=4, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, UPCAST=None),
    "triptych.kernels.triton.prefill_attention:_varlen_kernel": dict(
        D=80, D_PAD=128, BLOCK_M=64, BLOCK_N=64, UPCAST=None),
    "triptych.kernels.triton.norm_rope:_rms_norm_kernel": dict(N=4096, BLOCK=4096, HAS_RES=True),
    "triptych.kernels.triton.norm_rope:_mrope_kernel": dict(
        NH=32, HALF=64, HALF_PAD=64, NH_PAD=32, S0=16, S1=24),
}
_INT32_PTRS = {"bt_ptr", "seq_lens_ptr", "cu_q_ptr", "cu_ptr", "part_ptr"}
_INT64_PTRS = {"slot_ptr", "pos_ptr"}
_FP32_PTRS = {"part_out_ptr", "part_m_ptr", "part_l_ptr", "cache_ptr"}
_FP32_SCALARS = {"scale", "eps"}


def _signature(arg_names: list[str], constexprs: dict, dtype: str) -> dict[str, str]:
    sig = {}
    for name in arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _INT32_PTRS:
            sig[name] = "*i32"
        elif name in _INT64_PTRS:
            sig[name] = "*i64"
        elif name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        elif name in _FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90 = H100/H200)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="tensor dtypes to compile for")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces kernels with Python functions")
        return 2
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for spec, consts in _LAUNCHES.items():
        mod, name = spec.split("#")[0].split(":")
        name_shown = name + ("" if "#" not in spec else " (" + spec.split("#")[1] + ")")
        fn = getattr(importlib.import_module(mod), name)
        for dtype in args.dtypes.split(","):
            c = dict(consts)
            if "UPCAST" in c:
                c["UPCAST"] = dtype == "fp32"
            t0 = time.perf_counter()
            try:
                # Like a real launch: Triton's JIT marks 16-aligned pointers and strides.
                attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                         if n not in c and (n.endswith("_ptr") or n.startswith("stride_"))}
                k = triton.compile(ASTSource(fn, _signature(fn.arg_names, c, dtype), c, attrs),
                                   target=target)
                n_regs = getattr(k, "n_regs", None)
                print(f"ok    {name_shown:<28} {dtype:<5} sm_{args.arch} "
                      f"({time.perf_counter() - t0:.1f} s, {len(k.asm['cubin'])} B cubin"
                      f"{'' if n_regs is None else f', {n_regs} regs'})")
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"FAIL  {name_shown:<28} {dtype:<5} sm_{args.arch}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
