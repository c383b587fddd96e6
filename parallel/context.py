"""TPContext: this process's place in a tensor-parallel group, and the group's collectives.

The group is a standalone torch.distributed backend object (gloo on CPU, NCCL on CUDA),
not the process-global default group: two groups (or none) can live in one process, and
nothing here needs resetting between tests. Every collective runs under the group's
timeout (``COLLECTIVE_TIMEOUT_S``): a rank that died makes its peers' next collective fail
at once (the connection closes), a rank that hangs makes it fail after the timeout; a
collective never waits forever.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from triptych.engine.runner.model_runner import RunnerBroken

logger = logging.getLogger("triptych.tp")

# NOTE: long enough for the slowest single step a rank may legitimately run while its peers
# wait (one large image through a CPU vision tower in "data" mode), short enough that a
# hung rank does not hold a group for long. A dead rank is noticed at once, not after this.
COLLECTIVE_TIMEOUT_S = 300.0


class TPGroupError(RunnerBroken):
    """The group cannot be trusted any more (a rank died, a collective failed or timed out):
    the worker must stop so the supervisor restarts the whole group.

    NOTE: not a RuntimeError, which callers catch to retry a request alone (the encode
    worker does): retrying on a broken group would keep a useless worker alive. A
    ``RunnerBroken``, so the engine core does not bisect the batch either."""


@dataclass
class TPContext:
    """Rank ``rank`` of ``size``; ``pg`` is the backend (None for the size-1 stand-in)."""

    rank: int
    size: int
    pg: Any = None

    @classmethod
    def connect(cls, store: Any, rank: int, size: int, device: torch.device,
                timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TPContext:
        """Join the group meeting at ``store`` (a FileStore in rank 0's private directory).
        Gloo binds to loopback only: the ranks of a group share one host."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(store, rank, size, opts)
        return cls(rank, size, pg)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        self.pg.allreduce(t).wait()
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape everywhere) on rank 0, in rank order; None elsewhere."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        self.pg.gather(out, t, 0).wait()
        return out if self.rank == 0 else None

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (all ranks agree on a size, e.g. KV blocks)."""
        t = torch.tensor([value], dtype=torch.int64)
        if getattr(self.pg, "name", lambda: "")() == "nccl":
            t = t.cuda()
        self.pg.allreduce(t, dist.ReduceOp.MIN).wait()
        return int(t.item())

    def close(self) -> None:
        """Release the backend (its sockets); the context is unusable afterwards."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception as e:  # noqa: BLE001 (a broken group cannot shut down cleanly)
                logger.debug("group shutdown: %s", e)
            self.pg = None
