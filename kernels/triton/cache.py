"""Triton KV write (`reshape_and_cache`): scatter new K/V rows into their paged slots.

    slot = block_id * block_size + offset  ->  k_cache.view(-1, Hkv, D)[slot] = key[t]

Pure copies (with a cast to the cache dtype), so no fp32 upcast is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triptych.kernels.triton.common import check_cache, check_tensors, require


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_kt, stride_vt, ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token: copies its [Hkv*D] row of K and of V to cache slot `slot`.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    k = tl.load(key_ptr + t * stride_kt + offs, mask=m)
    v = tl.load(value_ptr + t * stride_vt + offs, mask=m)
    dst = slot * ROW + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv*D] without a copy when each token's row is contiguous
    (k/v usually are strided views of one qkv projection)."""
    t, hkv, d = x.shape
    if x.stride(2) == 1 and x.stride(1) == d:
        return x.as_strided((t, hkv * d), (x.stride(0), 1))
    return x.contiguous().view(t, hkv * d)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into their cache slots, in place.

    key, value: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    (contiguous); slot_mapping: [T] int, -1 = padding (skipped). Same contract as
    ``torch_ref.reshape_and_cache``; slots must be distinct and < num_blocks * block_size.
    """
    fn = "reshape_and_cache"
    check_tensors(fn, {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache},
                  {"slot_mapping": slot_mapping})
    check_cache(fn, k_cache, v_cache)
    require(key.dim() == 3 and value.shape == key.shape,
            lambda: f"{fn}: key {tuple(key.shape)} / value {tuple(value.shape)} must be [T, Hkv, D]")
    t, hkv, d = key.shape
    require(k_cache.shape[2:] == (hkv, d),
            lambda: f"{fn}: cache heads {tuple(k_cache.shape[2:])} differ from key's {(hkv, d)}")
    require(slot_mapping.shape == (t,), lambda: f"{fn}: slot_mapping must be [{t}]")
    if t == 0:
        return
    key, value = _rows(key), _rows(value)
    row = hkv * d
    _reshape_and_cache_kernel[(t,)](key, value, k_cache, v_cache, slot_mapping,
                                    key.stride(0), value.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row))
