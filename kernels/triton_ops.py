"""The Triton backend: same functions and signatures as ``torch_ref``."""
from triptych.kernels.triton_cache import reshape_and_cache
from triptych.kernels.triton_decode_attention import paged_decode_attention
from triptych.kernels.triton_norm_rope import apply_mrope, rms_norm
from triptych.kernels.triton_prefill_attention import paged_prefill_attention, varlen_attention

__all__ = ["reshape_and_cache", "paged_decode_attention", "paged_prefill_attention",
           "varlen_attention", "rms_norm", "apply_mrope"]
