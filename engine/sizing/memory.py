"""GPU memory the way vLLM v1 sizes it: a worker's share of its device, what it needs besides
its KV cache (measured by a profile run, engine/sizing/profile_run.py), and the KV cache
from the rest.

    share = gpu_memory_utilization x total         what this worker may hold on its device
      - weights                                    torch memory allocated by the load
      - peak activation                            max_memory_allocated over the profile step
      - non-torch memory                           (device used - torch reserved), its growth
                                                   since the worker started (cuBLAS, NCCL)
      - encoder cache                              encoder_cache_size: vision embeddings later
      = KV cache bytes -> blocks (one block: every layer's K and V, this rank's KV heads)

A worker refuses to start, in one line naming the flag, when less than its share is free
(vLLM's rule); workers that share a device start one at a time, so each one sees the device
after the previous one took its share. Each process's CUDA context lies outside the shares
(the device's ``1 - sum of shares``). ``kv_cache_memory`` set: the cache takes that many
bytes and no profile runs; ``num_kv_blocks``: that many blocks, whatever the memory. On the
CPU: ``kv_cache_memory`` (default 1GiB), as always: no share, no profile.

Everything here but ``MemorySnapshot.take`` is arithmetic on numbers (tested on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from triptych.config import parse_size

GIB = 1 << 30
CPU_KV_CACHE_MEMORY = "1GiB"  # kv_cache_memory on the CPU when it is not given


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class MemorySnapshot:
    """The device's memory as one process sees it at one moment (bytes)."""

    free: int  # cudaMemGetInfo: free on the whole device (every process)
    total: int
    torch_reserved: int = 0  # this process's caching allocator: held from the device
    torch_allocated: int = 0  # ... and in live tensors

    @property
    def non_torch(self) -> int:
        """Device memory in use that this process's allocator does not hold (other
        processes, CUDA contexts, cuBLAS workspaces, NCCL buffers)."""
        return self.total - self.free - self.torch_reserved

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_reserved(device),
                   torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class Usage:
    """What a worker holds on its device besides its KV cache (bytes)."""

    weights: int  # parameters and buffers (everything the load allocated)
    peak_activation: int  # the profile step's peak above what was allocated before it
    non_torch: int  # growth of non-torch memory since the worker started
    encoder_cache: int = 0  # room the encoder cache will fill with embeddings
    cuda_graphs: int = 0  # what the decode CUDA graphs hold (a trial capture measures it)

    @property
    def total(self) -> int:
        return self.weights + self.peak_activation + self.non_torch + self.encoder_cache + \
            self.cuda_graphs

    def describe(self) -> str:
        return (f"weights {gib(self.weights)}, peak activation {gib(self.peak_activation)}, "
                f"non-torch {gib(self.non_torch)}, encoder cache {gib(self.encoder_cache)}"
                + (f", CUDA graphs {gib(self.cuda_graphs)}" if self.cuda_graphs else ""))


def share_flag(config: Any, pool: str = "") -> str:
    """The flag that set this worker's share: its pool's own, else gpu_memory_utilization."""
    if pool in ("encode", "prefill", "decode") and \
            getattr(config, f"{pool}_gpu_memory_utilization", None) is not None:
        return f"--{pool}-gpu-memory-utilization"
    return "--gpu-memory-utilization"


def requested_bytes(snap: MemorySnapshot, share: float, flag: str, where: str = "the GPU"
                    ) -> int:
    """``share`` of the device in bytes; ValueError (one line naming ``flag``) when less
    than that is free now (vLLM's rule: another process, or a worker of this server that
    started earlier, holds the rest)."""
    want = int(snap.total * share)
    if snap.free < want:
        raise ValueError(
            f"{where} has {gib(snap.free)} free of {gib(snap.total)}, less than this worker's "
            f"share {share:g} ({gib(want)}, {flag}): lower {flag} or free the device")
    return want


def start_snapshot(config: Any, role: str, pool: str, device: torch.device
                   ) -> MemorySnapshot | None:
    """CUDA: the device as this worker (or rank) finds it, before it loads anything;
    ValueError when less than its share is free. An encode worker without a share of its
    own measures what it needs instead (the router splits the rest by it). None on the CPU."""
    if device.type != "cuda":
        return None
    snap = MemorySnapshot.take(device)
    if not (role == "encode" and config.encode_gpu_memory_utilization is None):
        index = torch.cuda.current_device() if device.index is None else device.index
        requested_bytes(snap, config.gpu_memory_utilization, share_flag(config, pool),
                        f"cuda:{index}")
    return snap


def usage_after_profile(start: MemorySnapshot, weights: int, before_profile: int,
                        peak_allocated: int, after: MemorySnapshot, encoder_cache: int = 0
                        ) -> Usage:
    """Usage from the snapshots around a profile run. ``weights``: bytes the load
    allocated; ``before_profile``: torch memory allocated when the profile step began
    (weights and the small profile cache: both are counted elsewhere); ``peak_allocated``:
    torch's peak during the step."""
    return Usage(weights=weights, peak_activation=max(0, peak_allocated - before_profile),
                 non_torch=max(0, after.non_torch - start.non_torch), encoder_cache=encoder_cache)


def kv_cache_bytes(requested: int, usage: Usage, flag: str) -> int:
    """The share left for the KV cache; ValueError (one line) when nothing is left."""
    kv = requested - usage.total
    if kv <= 0:
        raise ValueError(f"this worker's share ({gib(requested)}, {flag}) leaves no room for "
                         f"a KV cache after {usage.describe()}: raise {flag}, or lower "
                         "--max-num-batched-tokens / --max-num-seqs")
    return kv


def blocks_for(budget: int, per_block: int, knob: str) -> int:
    """How many blocks of ``per_block`` bytes ``budget`` holds (ValueError below 2)."""
    n = budget // per_block
    if n < 2:
        raise ValueError(f"KV cache budget {budget} bytes holds no blocks ({per_block} bytes "
                         f"each): raise {knob}")
    return int(n)


def explicit_kv_bytes(config: Any, device_type: str) -> int | None:
    """The KV cache bytes the knobs fix for one worker (the whole group's on the CPU, where
    ranks share the host), or None on CUDA when a profile run must size it."""
    if config.kv_cache_memory is not None:
        return parse_size(config.kv_cache_memory)
    return None if device_type == "cuda" else parse_size(CPU_KV_CACHE_MEMORY)


def kv_blocks_from_share(requested: int, usage: Usage, per_block: int, flag: str) -> int:
    """KV blocks of a profiled worker: what its share leaves, in whole blocks."""
    return blocks_for(kv_cache_bytes(requested, usage, flag), per_block, flag)


def encode_share(usage: Usage, total: int) -> float:
    """An encode worker's measured share of its device (weights, peak, non-torch memory and
    its encoder cache), rounded up to 0.001 so the others' shares leave it room."""
    return -(-usage.total * 1000 // total) / 1000


def release_device_memory() -> None:
    """Free what dropped engines held: collect their reference cycles, then (CUDA) give
    the caching allocator's free blocks back to the device."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
