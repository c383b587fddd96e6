"""Layout: which worker pools run, from the pool-size knobs.

    encode_workers  prefill_workers  decode_workers   layout
    0               0                0                colocated x data_parallel_size
    0               0                D                PD: D decode workers that prefill and encode
    E               0                D                E+PD: encode pool, decode workers prefill
    0               P                D                P+D: prefill workers run the vision tower
    E               P                D                E+P+D

On CUDA, ``gpu_memory_utilization`` is each worker's share of its device (engine/sizing/memory.py).
The local workers of a layout share their GPUs (every worker's rank r on cuda:r), so their
shares split the server's: ``GpuShares`` below; Ray places each rank on a GPU of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from triptych.config import EngineConfig, parse_size

GPU_POOLS = ("encode", "prefill", "decode")  # pools with a --<pool>-gpu-memory-utilization

# NOTE: CPU KV cache bytes of each worker when --kv-cache-memory is left at its default.
# Every worker allocates its own cache. A decode (or colocated) worker keeps every running
# request's blocks to the end of its answer; a prefill worker of P+D keeps a prompt's blocks
# only until they are handed to a decode worker, so it needs far less. Encode workers hold
# no KV cache.
POOL_KV_CACHE_MEMORY = {"colocated": 1 << 30, "decode": 1 << 30, "prefill": 512 << 20}


@dataclass(frozen=True)
class GpuShares:
    """How the local workers sharing one CUDA device split it: each worker's
    ``gpu_memory_utilization`` (its share of the device's total memory).

        encode workers     --encode-gpu-memory-utilization, else what each one measured
                           it needs at start (weights, peak activation, encoder cache)
        prefill / decode   their --<pool>-gpu-memory-utilization, else equal parts of
        (colocated x N)    what the others leave of --gpu-memory-utilization
        every worker       shares on the device sum to at most 1

    Workers start one at a time (router/supervisor.py): encode first, so the others'
    shares are known before they start."""

    pools: dict[str, int]  # pool -> workers, all on the device
    utilization: float  # --gpu-memory-utilization: the server's share of the device
    overrides: dict[str, float] = field(default_factory=dict)  # --<pool>-gpu-memory-...

    def shares(self, encode_need: float = 0.0) -> dict[str, float]:
        """Each pool's per-worker share, given the share each encode worker measured
        (0 before they have); ValueError (one line) when they cannot fit."""
        fixed = {p: self.overrides[p] for p in self.pools if p in self.overrides}
        if "encode" in self.pools:
            fixed.setdefault("encode", encode_need)
        rest = [p for p in self.pools if p not in fixed]
        left = self.utilization - sum(self.pools[p] * v for p, v in fixed.items())
        if rest and left <= 0:
            raise ValueError(f"the shares ({self._spent(fixed)}) leave nothing of "
                             f"--gpu-memory-utilization {self.utilization:g} for the "
                             f"{' and '.join(rest)} workers: raise it or lower the others")
        each = round(left / max(1, sum(self.pools[p] for p in rest)), 6)
        out = {**fixed, **dict.fromkeys(rest, each)}
        used = sum(self.pools[p] * v for p, v in out.items())
        if used > 1 + 1e-9:
            raise ValueError(f"the workers sharing a GPU take {used:.3g} of its memory "
                             f"({self._spent(out)}): their shares (--gpu-memory-utilization, "
                             "--<pool>-gpu-memory-utilization) must sum to at most 1")
        return out

    def _spent(self, shares: dict[str, float]) -> str:
        return ", ".join(f"{p} {self.pools[p]} x {v:.3g}" for p, v in shares.items())

    def share(self, pool: str, encode_need: float = 0.0) -> float | None:
        """``gpu_memory_utilization`` of a worker of ``pool`` (None: an encode worker
        without an override measures its own need)."""
        if pool == "encode" and pool not in self.overrides:
            return None
        return self.shares(encode_need)[pool]


@dataclass(frozen=True)
class Layout:
    pools: dict[str, int]  # pool name -> workers, in request order (encode, prefill, decode)
    tp: dict[str, int] = field(default_factory=dict)  # pool name -> ranks of each worker
    # pool name -> CPU KV cache bytes of each of its workers (pools with a KV cache only)
    kv_cache_memory: dict[str, int] = field(default_factory=dict)
    # pool name -> each worker's gpu_memory_utilization where it is not the server's
    gpu_memory_utilization: dict[str, float] = field(default_factory=dict)
    gpu: GpuShares | None = None  # the local workers share a CUDA device (start in turn)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Layout:
        if not config.decode_workers:
            pools = {"colocated": config.data_parallel_size}
        else:
            pools = {k: v for k, v in {"encode": config.encode_workers,
                                       "prefill": config.prefill_workers,
                                       "decode": config.decode_workers}.items() if v}
        cuda = _on_cuda(config)
        gpu = None
        overrides = {p: v for p in GPU_POOLS
                     if (v := getattr(config, f"{p}_gpu_memory_utilization")) is not None}
        shares = dict(overrides)
        if cuda and config.distributed_executor_backend == "mp" and sum(pools.values()) > 1:
            gpu = GpuShares(pools, config.gpu_memory_utilization, overrides)
            shares = {p: v for p in pools if (v := gpu.share(p)) is not None}
        return cls(pools, {p: config.pool_tensor_parallel_size(p) for p in pools},
                   pool_kv_cache_memory(config, pools, cuda), shares, gpu)

    def worker_knobs(self, pool: str) -> dict[str, int | float]:
        """What a worker of ``pool`` gets on top of the engine config: its ranks, its KV
        cache budget and its share of the GPU (where they differ from the config's)."""
        knobs: dict[str, int | float] = {"tensor_parallel_size": self.tp[pool]}
        if pool in self.kv_cache_memory:
            knobs["kv_cache_memory"] = self.kv_cache_memory[pool]
        if pool in self.gpu_memory_utilization:
            knobs["gpu_memory_utilization"] = self.gpu_memory_utilization[pool]
        return knobs

    @property
    def in_process(self) -> bool:
        """One colocated single-rank engine: the offline LLM runs it in its own process."""
        return self.pools == {"colocated": 1} and self.tp.get("colocated", 1) == 1

    @property
    def num_ranks(self) -> int:
        """Torch processes of all workers (each worker is a group of its pool's TP size)."""
        return sum(n * self.tp.get(p, 1) for p, n in self.pools.items())

    @property
    def main_pool(self) -> str:
        """The pool whose workers stream tokens to the end of a request."""
        return "colocated" if "colocated" in self.pools else "decode"

    @property
    def has_encode_pool(self) -> bool:
        return "encode" in self.pools

    @property
    def has_prefill_pool(self) -> bool:
        return "prefill" in self.pools

    @property
    def pixel_pool(self) -> str:
        """The pool whose workers run the vision tower (and so receive pixels)."""
        if self.has_encode_pool:
            return "encode"
        return "prefill" if self.has_prefill_pool else self.main_pool

    @property
    def num_workers(self) -> int:
        return sum(self.pools.values())

    def pools_for(self, has_media: bool) -> list[str]:
        """Pools a request needs: text-only requests never touch the encode pool."""
        return [p for p in self.pools if has_media or p != "encode"]

    def __str__(self) -> str:
        tp = {p: t for p, t in self.tp.items() if t > 1}
        ranks = (" (" + ", ".join(f"{p} tp{t}" for p, t in tp.items()) + ")") if tp else ""
        if "colocated" in self.pools:
            return f"colocated x{self.pools['colocated']}{ranks}"
        name = "".join(f"{n}{p[0]}" for p, n in self.pools.items())
        return (name if self.has_prefill_pool else f"{name} (decode workers prefill)") + ranks


def _on_cuda(config: EngineConfig) -> bool:
    from triptych.engine.sizing.model_shape import resolve_device

    return resolve_device(config.device).type == "cuda"


def pool_kv_cache_memory(config: EngineConfig, pools: dict[str, int], cuda: bool = False
                         ) -> dict[str, int]:
    """Each KV-holding pool's per-worker budget: the user's --kv-cache-memory for every
    worker when it is set, else on the CPU POOL_KV_CACHE_MEMORY (on CUDA, unset: each
    worker's profile run sizes it from its share of the GPU)."""
    if config.kv_cache_memory is None and cuda:
        return {}
    given = config.kv_cache_memory
    return {p: parse_size(given) if given is not None else POOL_KV_CACHE_MEMORY[p]
            for p in pools if p in POOL_KV_CACHE_MEMORY}
