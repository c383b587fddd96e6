"""CPU-only kernels and their C++ builds: packed linear layers (``linear``) with the GEMV
(``gemv``) and panel GEMM (``panel_gemm``, also the sampler's host argmax), the fused
paged-decode attention (``paged_attention``), the fused element-wise ops (``fused_ops``)
and the compiler driver they share (``build``).

Nothing here is imported for a CUDA engine: ``triptych.kernels.platform`` decides what a
device uses, and only the CPU's choices reach this package.
"""
