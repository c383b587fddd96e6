"""The CUDA engine's step, rehearsed on the CPU: what a GPU engine runs, minus the GPU.

A CPU engine takes the CPU's own paths (engine/device/platform.py): packed linear weights with
their greedy head and C++ argmax, host arrays used where they are, no CUDA graphs. The
checks that a GPU engine's step reads nothing back (tests/test_host_syncs.py) and the GPU
script's smoke run (`bench gpu --cpu-smoke`) need the CUDA engine's path instead. Build
the engine with the CUDA engine's knobs (``REHEARSAL_KNOBS``: the Triton kernels under
TRITON_INTERPRET=1, ``F.linear`` in the model's dtype), then ``rehearse_cuda`` puts the
rest of it on that path:

    sampler        logits from the LM head, torch's argmax on them (no C++ argmax, no
                   greedy head)
    staging        the step's inputs, the sampler's arrays and KV imports packed into one
                   buffer each, read through typed views of it (the GPU's layout)
    CUDA graphs    decode steps through CudaGraphRunner over its persistent buffers
                   (capture rehearsed: warm-up forwards; replays run eagerly)

What stays the CPU's: the copies themselves (the device is the host), pinned memory and
events, and the capture. Async scheduling is its own knob (``async_scheduling=True``).
"""
from __future__ import annotations

from typing import Any

from triptych.engine.device.device_io import StepStaging
from triptych.engine.sample.sampler import torch_argmax

REHEARSAL_KNOBS = {"attention_backend": "triton", "cpu_gemm": "torch"}


def rehearse_cuda(core: Any, graph_sizes: list[int] | None = None) -> None:
    """Turn a CPU engine core built with ``REHEARSAL_KNOBS`` onto the CUDA engine's path
    (module docstring); ``graph_sizes``: decode batch sizes replayed through the graph
    runner (None, or a model whose decode a graph cannot hold: eager decode steps)."""
    runner = core.runner
    if core.attention_backend != "triton" or getattr(core.model, "pack_head", None):
        raise ValueError("rehearse_cuda needs an engine built with REHEARSAL_KNOBS "
                         f"{REHEARSAL_KNOBS} (and TRITON_INTERPRET=1)")
    runner.sampler.argmax = torch_argmax
    runner.greedy_head = False
    for name in ("staging", "sample_staging", "kv_staging"):
        setattr(runner, name, StepStaging(runner.device, pack=True))
    if graph_sizes and not getattr(core.model, "cuda_graph_blocker", ""):
        runner.enable_cuda_graphs(list(graph_sizes), core.max_model_len)
