"""Layout: which worker pools run, from the pool-size knobs.

    encode_workers  prefill_workers  decode_workers   layout
    0               0                0                colocated x data_parallel_size
    0               0                D                PD: D decode workers that prefill and encode
    E               0                D                E+PD: encode pool, decode workers prefill
    0               P                D                P+D: prefill workers run the vision tower
    E               P                D                E+P+D
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from triptych.config import EngineConfig, parse_size

# NOTE: CPU KV cache bytes of each worker when --kv-cache-memory is left at its default.
# Every worker allocates its own cache. A decode (or colocated) worker keeps every running
# request's blocks to the end of its answer; a prefill worker of P+D keeps a prompt's blocks
# only until they are handed to a decode worker, so it needs far less. Encode workers hold
# no KV cache.
POOL_KV_CACHE_MEMORY = {"colocated": 1 << 30, "decode": 1 << 30, "prefill": 512 << 20}
_DEFAULT_KV_CACHE_MEMORY = next(f.default for f in dataclasses.fields(EngineConfig)
                                if f.name == "kv_cache_memory")


@dataclass(frozen=True)
class Layout:
    pools: dict[str, int]  # pool name -> workers, in request order (encode, prefill, decode)
    tp: dict[str, int] = field(default_factory=dict)  # pool name -> ranks of each worker
    # pool name -> CPU KV cache bytes of each of its workers (pools with a KV cache only)
    kv_cache_memory: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Layout:
        if not config.decode_workers:
            pools = {"colocated": config.data_parallel_size}
        else:
            pools = {k: v for k, v in {"encode": config.encode_workers,
                                       "prefill": config.prefill_workers,
                                       "decode": config.decode_workers}.items() if v}
        return cls(pools, {p: config.pool_tensor_parallel_size(p) for p in pools},
                   pool_kv_cache_memory(config, pools))

    def worker_knobs(self, pool: str) -> dict[str, int]:
        """What a worker of ``pool`` gets on top of the engine config: its ranks and its KV
        cache budget."""
        knobs = {"tensor_parallel_size": self.tp[pool]}
        if pool in self.kv_cache_memory:
            knobs["kv_cache_memory"] = self.kv_cache_memory[pool]
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


def pool_kv_cache_memory(config: EngineConfig, pools: dict[str, int]) -> dict[str, int]:
    """Each KV-holding pool's per-worker budget: the user's --kv-cache-memory for every
    worker when it is set to anything but its default, else POOL_KV_CACHE_MEMORY."""
    given = parse_size(config.kv_cache_memory)
    explicit = given != parse_size(_DEFAULT_KV_CACHE_MEMORY)
    return {p: given if explicit else POOL_KV_CACHE_MEMORY[p]
            for p in pools if p in POOL_KV_CACHE_MEMORY}
