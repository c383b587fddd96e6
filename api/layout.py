"""Layout: which worker pools run, from the pool-size knobs.

    encode_workers  prefill_workers  decode_workers   layout
    0               0                0                colocated x data_parallel_size
    0               0                D                PD: D decode workers that prefill and encode
    E               0                D                E+PD: encode pool, decode workers prefill
    0               P                D                P+D: prefill workers run the vision tower
    E               P                D                E+P+D
"""
from __future__ import annotations

from dataclasses import dataclass

from triptych.config import EngineConfig


@dataclass(frozen=True)
class Layout:
    pools: dict[str, int]  # pool name -> workers, in request order (encode, prefill, decode)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Layout:
        if not config.decode_workers:
            return cls({"colocated": config.data_parallel_size})
        pools = {"encode": config.encode_workers, "prefill": config.prefill_workers,
                 "decode": config.decode_workers}
        return cls({k: v for k, v in pools.items() if v})

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
        if "colocated" in self.pools:
            return f"colocated x{self.pools['colocated']}"
        name = "".join(f"{n}{p[0]}" for p, n in self.pools.items())
        return name if self.has_prefill_pool else f"{name} (decode workers prefill)"
