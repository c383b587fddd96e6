"""The Triton backend: same functions and signatures as ``torch_ref`` (one kernel module
each; shared checks and the online-softmax tile step in ``triton_common``).

Wrappers accept CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (set before this
module is imported: ``@triton.jit`` reads it at decoration time).
"""
from __future__ import annotations

# no Triton kernel for the MLP activation: on CUDA torch's silu and mul are two launches
from triptych.kernels.torch_ref import silu_and_mul
from triptych.kernels.triton.cache import reshape_and_cache
from triptych.kernels.triton.decode_attention import paged_decode_attention
from triptych.kernels.triton.norm_rope import apply_mrope, rms_norm
from triptych.kernels.triton.prefill_attention import paged_prefill_attention, varlen_attention

__all__ = ["apply_mrope", "paged_decode_attention", "paged_prefill_attention",
           "reshape_and_cache", "rms_norm", "silu_and_mul", "varlen_attention"]
