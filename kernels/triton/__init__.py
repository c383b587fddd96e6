"""Triton kernels (CUDA; on the CPU only under ``TRITON_INTERPRET=1``, for tests): the
paged decode and prefill attention, varlen vision attention, KV cache write, RMSNorm and
M-RoPE. ``ops`` gathers them under ``torch_ref``'s signatures; ``common`` holds the checks
and the online-softmax step they share.
"""
