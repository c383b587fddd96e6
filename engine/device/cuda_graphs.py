"""Decode steps as CUDA graphs: the forward (embedding through the LM head) captured once
per padded batch size, replayed with the step's inputs copied into persistent buffers.

    a step of B decode rows -> bucket = the smallest captured size >= B (none: eager)
    persistent inputs, rows [0, B): the step's; rows [B, bucket): padding that
        reads token 0 at position 0, writes no KV (slot -1) and attends to nothing
        (length 0: zeros, never 0 / 0; kernels/triton/decode_attention.py)
    replay -> hidden states [bucket, hidden] in the graph's own output; rows [0, B) are
        the step's; the LM head runs after the replay on those B rows only

A captured launch cannot depend on anything that changes between replays: no device value
is read by the host (engine/device/device_io.py), the batch size is the bucket's, and the decode
attention's split count is fixed per bucket (``choose_splits`` at the engine's longest
context). Its partition, which follows this step's longest context, is read by the kernel
from a persistent device scalar that the step's one copy brings.

The graph ends at the hidden states, as vLLM's does: a captured size keeps its output
alive between replays, and [size, vocab] fp32 logits would hold 0.67 GB at 128 rows, 2.6 GB
at 256 (vocab 151,936), taken from the KV cache; [size, hidden] holds 1/50 of that. The LM
head (one GEMM) and sampling run eagerly after the replay. Steps with prefill rows,
tensor-parallel groups (their all-reduce runs on gloo or between processes) and models
whose forward reads the device (MoE's expert counts) run eagerly, and the log says why.
All captured sizes share one memory pool; capture runs largest first, after warm-up.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from triptych.engine.runner.forward_context import (
    AttentionMetadata,
    ForwardContext,
    forward_context,
)

logger = logging.getLogger("triptych.cuda_graphs")

DEFAULT_MAX_CAPTURE = 256  # the largest captured batch when neither knob says otherwise


def capture_sizes(explicit: list[int] | None, max_size: int | None,
                  max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending (vLLM's knobs): ``cudagraph_capture_sizes`` as
    given, else 1, 2, 4 and every multiple of 8 up to ``max_cudagraph_capture_size``
    (default: max_num_seqs rounded up to 8, at most 256); either way none above the cap."""
    cap = max_size if max_size is not None else \
        min(DEFAULT_MAX_CAPTURE, -(-max_num_seqs // 8) * 8)
    if cap < 1:
        raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {cap}")
    if explicit is not None:
        if not explicit or any(not isinstance(s, int) or s < 1 for s in explicit):
            raise ValueError("cudagraph_capture_sizes must be a list of positive batch sizes, "
                             f"got {explicit!r}")
        return sorted({s for s in explicit if s <= cap} or {min(explicit)})
    return sorted({s for s in [1, 2, 4, *range(8, cap + 1, 8)] if s <= cap} | {cap})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``n`` rows (None: more rows than any)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphPlan:
    """Whether this engine captures decode graphs, and of which sizes (or why not)."""

    sizes: list[int]  # empty: eager
    reason: str = ""  # why eager, for the log

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)


def graph_plan(config: Any, device: torch.device, model: Any, backend: str,
               tp_size: int) -> GraphPlan:
    """The engine's decode graphs from its knobs (``enforce_eager``, ``compilation_config``)
    and what can be captured here."""
    if device.type != "cuda":
        return GraphPlan([], "CUDA graphs need a CUDA device")
    if config.enforce_eager:
        return GraphPlan([], "enforce_eager is set (--no-enforce-eager captures the decode "
                             "steps as CUDA graphs)")
    if backend != "triton":
        return GraphPlan([], f"attention backend {backend} (graphs need the triton backend)")
    if tp_size > 1:
        return GraphPlan([], "tensor parallelism: the ranks' all-reduce runs outside a graph")
    why = getattr(model, "cuda_graph_blocker", "")
    if why:
        return GraphPlan([], why)
    cc = config.compilation_dict()
    return GraphPlan(capture_sizes(cc.get("cudagraph_capture_sizes"),
                                   cc.get("max_cudagraph_capture_size"), config.max_num_seqs))


class CudaGraphRunner:
    """The captured decode graphs of one model runner (``capture``, ``bucket``, ``replay``)."""

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 ops: Any, sizes: list[int], max_model_len: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        from triptych.kernels.triton.common import num_sms
        from triptych.kernels.triton.decode_attention import choose_splits, decode_block_n

        self.model, self.kv_caches, self.ops, self.sizes = model, kv_caches, ops, sizes
        self.max_model_len, self.device = max_model_len, device
        s, max_blocks = max(sizes), -(-max_model_len // block_size)
        self.block_n = decode_block_n(dtype, head_dim)
        self.splits = {b: choose_splits(b, num_kv_heads, max_model_len, self.block_n,
                                        num_sms(device)) for b in sizes}
        kw: dict[str, Any] = {"device": device}
        self.input_ids = torch.zeros(s, dtype=torch.int64, **kw)
        self.positions = torch.zeros(3, s, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((s,), -1, dtype=torch.int64, **kw)
        self.block_tables = torch.zeros(s, max_blocks, dtype=torch.int32, **kw)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, **kw)
        self.cu_seqlens_q = torch.arange(s + 1, dtype=torch.int32, **kw)
        self.partition = torch.full((1,), self.block_n, dtype=torch.int32, **kw)
        self.graphs: dict[int, Any] = {}  # size -> torch.cuda.CUDAGraph
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self.bytes_held = 0  # device memory the graphs hold (their pool), as measured
        self.num_replays = 0  # decode steps that ran in a graph

    def forward(self, size: int) -> torch.Tensor:
        """The model on the first ``size`` rows of the persistent buffers: hidden states
        [size, hidden] (what a graph captures; eager on any device, which is how the CPU
        tests run it)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], seq_lens=self.seq_lens[:size],
            max_query_len=1, max_seq_len=self.max_model_len, padded=True,
            decode_splits=self.splits[size], decode_partition=self.partition)
        ids = self.input_ids[:size]
        with forward_context(ForwardContext(meta, self.kv_caches, self.ops)):
            return self.model(ids, self.positions[:, :size], self.model.embed_tokens(ids))

    @torch.inference_mode()
    def capture(self) -> int:
        """Warm up and capture every size, largest first, into one pool; returns the bytes
        the graphs hold and logs them with the time taken.

        Off CUDA (the CPU's rehearsal of the GPU path, engine/device/rehearsal.py) the same
        warm-up forwards run and every later "replay" runs ``forward`` eagerly over the
        same persistent buffers: all but the capture itself."""
        t0 = time.perf_counter()
        if self.device.type != "cuda":
            for size in sorted(self.sizes, reverse=True):
                self.forward(size)
            self.eager_replay = True
            return 0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for size in sorted(self.sizes, reverse=True):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sizes workspaces
                for _ in range(2):
                    self.forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.bytes_held = max(0, torch.cuda.memory_reserved(self.device) - before)
        logger.info("CUDA graphs: %d decode batch sizes (%d..%d) captured in %.1f s, holding "
                    "%.0f MiB (--enforce-eager runs every step eagerly)", len(self.graphs),
                    min(self.sizes), max(self.sizes), time.perf_counter() - t0,
                    self.bytes_held / 2**20)
        return self.bytes_held

    def release(self) -> None:
        """Drop the graphs and their pool (the caller empties the allocator's cache)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def bucket(self, num_rows: int, max_query_len: int, whole: bool) -> int | None:
        """The graph a step runs in, or None for eager: decode rows only (one token
        each), every row sampled in order, and a captured size that holds them."""
        if max_query_len != 1 or not whole or not (self.graphs or self.eager_replay):
            return None
        return bucket_for(num_rows, self.sizes)

    eager_replay = False  # tests: "replay" runs ``forward`` eagerly (no CUDA here)

    def partition_for(self, bucket: int, max_seq_len: int) -> np.ndarray:
        """The step's tokens per split (the host array staged with the step's inputs)."""
        from triptych.kernels.triton.decode_attention import partition_for

        return np.array([partition_for(max_seq_len, self.splits[bucket], self.block_n)],
                        dtype=np.int32)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, partition: torch.Tensor, bucket: int) -> torch.Tensor:
        """Copy the step's device inputs into the persistent buffers (padding the rest of
        the bucket), replay, and return the step's rows of the hidden states."""
        n, w = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:, :n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :w].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if bucket > n:  # padding rows: token 0 at position 0, no KV written, length 0
            self.input_ids[n:bucket].zero_()
            self.positions[:, n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].zero_()
        self.partition.copy_(partition)
        self.num_replays += 1
        if self.eager_replay:
            return self.forward(bucket)[:n]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
