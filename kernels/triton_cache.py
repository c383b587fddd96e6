"""Triton KV write (`reshape_and_cache`): scatter new K/V rows into their paged slots."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_kt, stride_vt, ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token: copies its [Hkv*D] row of K and of V to cache slot `slot`.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    k = tl.load(key_ptr + t * stride_kt + offs, mask=m)
    v = tl.load(value_ptr + t * stride_vt + offs, mask=m)
    dst = slot.to(tl.int64) * ROW + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] (contiguous);
    slot_mapping: [T] int (-1 skips). Same contract as ``torch_ref.reshape_and_cache``."""
    t, hkv, d = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (hkv, d), "cache head layout differs from key"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (t,) and key.device == k_cache.device == slot_mapping.device
    if t == 0:
        return
    key = key.reshape(t, hkv * d) if key.stride(-1) == 1 and key.stride(1) == d else \
        key.contiguous().view(t, hkv * d)
    value = value.reshape(t, hkv * d) if value.stride(-1) == 1 and value.stride(1) == d else \
        value.contiguous().view(t, hkv * d)
    row = hkv * d
    _reshape_and_cache_kernel[(t,)](key, value, k_cache, v_cache, slot_mapping,
                                    key.stride(0), value.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row))
