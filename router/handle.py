"""WorkerHandle: everything P0 knows about one worker, in one object.

One handle per worker slot of a pool, for the life of the router: its process (the
supervisor starts and restarts it; every restart is a new incarnation), what its Hello said,
its latest stats, whether it is alive, and the router's routing state for it (queued work,
the prompts and embeddings it probably holds). Forgetting what a worker held is clearing
its handle's indexes; nothing about a worker lives in a structure keyed by worker.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Any

from triptych.router.routing import PrefixIndex

EMBEDDING_INDEX_ENTRY_BYTES = 1 << 20  # rough size of one image's embedding (routing hint)


@dataclass(eq=False)
class WorkerHandle:
    """One worker slot of a pool; its process changes with every restart (incarnation)."""

    pool: str
    index: int
    config: dict[str, Any]  # EngineConfig keyword arguments for this worker
    num_threads: int = 1
    # -- the process (supervisor) --
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting | up | stalled (silent: being killed) | dead | stopped
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float = 0.0
    failures: int = 0  # consecutive short-lived incarnations (for the backoff)
    backoff_s: float = 0.0  # the wait before the pending (or last) restart
    remote: str | None = None  # a worker on another host: its identity (name#tag); not ours
    # to start or restart, alive while its heartbeats (stats) come
    last_seen: float = 0.0  # monotonic time of its last message or heartbeat
    busy_s: float = 0.0  # its last heartbeat: seconds inside the current step (0: idle)
    spawn_error: str = ""  # the last start of its process failed (fork EAGAIN, ...): why
    # -- what it told the router --
    info: dict[str, Any] = field(default_factory=dict)  # what its Hello said
    stats: dict[str, float] = field(default_factory=dict)  # its latest WorkerStats
    served: int = 0  # requests it did its part of: encoded, prefilled, or finished (/health)
    # -- routing (router/routing.py) --
    load: int = 0  # queued work charged by live attempts (tokens; patches on encode workers)
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(1))  # prompt blocks
    embeddings: PrefixIndex = field(default_factory=lambda: PrefixIndex(1))  # mm hashes it
    # probably holds in its encoder cache (prefilling workers of the encode layouts)

    @property
    def name(self) -> str:
        return self.remote.partition("#")[0] if self.remote else f"{self.pool}-{self.index}"

    @property
    def identity(self) -> str:
        """The ZMQ identity of its current incarnation."""
        return self.remote or f"{self.name}#{self.incarnation}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else self.info.get("pid")

    @property
    def weights(self) -> dict[str, Any]:
        """Its parts and weight bytes from its hello ({} before one); "ranks": a group's."""
        info = self.info
        if not info.get("weight_parts"):
            return {}
        ranks = {"ranks": info["rank_weight_bytes"]} if info.get("rank_weight_bytes") else {}
        return {"parts": info["weight_parts"], "bytes": dict(info.get("weight_bytes") or {}),
                **ranks}

    @property
    def up(self) -> bool:
        return self.state == "up"

    def on_hello(self, info: dict[str, Any]) -> None:
        """Its (new) incarnation said hello: size the routing indexes after its caches."""
        self.state = "up"
        self.info = info
        self.prefix.capacity = max(1, int(info.get("num_kv_blocks", 1)))
        self.embeddings.capacity = max(16, int(info.get("encoder_cache_bytes", 0))
                                       // EMBEDDING_INDEX_ENTRY_BYTES)

    def record_prompt(self, hashes: list[bytes]) -> None:
        """A prompt goes to this worker: its blocks will be in its prefix cache."""
        self.prefix.capacity = max(1, int(self.info.get("num_kv_blocks", 1)))
        self.prefix.record(hashes)

    def missing_embeddings(self, mm_hashes: list[str]) -> list[str]:
        """Of ``mm_hashes``, those it does not hold (in order, once each), recorded as held
        from now on: they are about to be sent to it."""
        missing = list(dict.fromkeys(h for h in mm_hashes if not self.embeddings.match([h])))
        self.embeddings.capacity = max(16, int(self.info.get("encoder_cache_bytes", 0))
                                       // EMBEDDING_INDEX_ENTRY_BYTES)
        self.embeddings.record(missing)
        return missing

    def forget_caches(self) -> None:
        """Its process died: a new incarnation starts with empty caches."""
        self.prefix.clear()
        self.embeddings.clear()
