"""Rank 0's side of a tensor-parallel step: the model runner and the vision encoder that
first tell the other ranks what to compute, then compute their own part with them.

    TPModelRunner.run_model   Forward(step arrays + vision rows) -> ranks; every rank runs
                              ModelRunner.run_model; logits slices gathered to rank 0
    TPEncoder.__call__        Encode(pixels or shares) -> ranks; the tower sharded by
                              weights, or split by patches (parallel/encoder_data.py)
    read_blocks / write_blocks  KV by block id as all heads (prefill export, decode import)

Everything between sending a command and its last collective is a ``collective`` section:
an error there means the ranks may be at another point of the sequence, so the group is
declared broken (``TPGroupError``) and the worker exits for the supervisor to restart it,
instead of the step being retried on a group out of step.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from triptych.parallel.encoder_data import encode_data_parallel, rank_pixels
from triptych.parallel.patch_balance import balance_by_patches
from triptych.parallel import wire as tp_wire
from triptych.engine.device.device_io import to_host
from triptych.engine.runner.input_batch import StepInputs
from triptych.engine.runner.model_runner import DeviceStep, ModelRunner
from triptych.parallel.group import TPGroup
from triptych.parallel.context import TPGroupError


@contextmanager
def collective(group: TPGroup, what: str) -> Iterator[None]:
    group.check()
    try:
        yield
    except TPGroupError as e:
        group.mark_broken(str(e))
        raise
    except Exception as e:
        group.mark_broken(f"{what} failed inside the tensor-parallel group: {e}")
        raise TPGroupError(group.broken) from e


def step_arrays(inp: StepInputs) -> list[Any]:
    return [getattr(inp, name) for name in tp_wire.STEP_ARRAYS]


class TPModelRunner(ModelRunner):
    """ModelRunner of rank 0: the same bookkeeping, the model run by the whole group."""

    greedy_head = False  # each rank holds a vocab slice of the head: logits are gathered

    def __init__(self, group: TPGroup, *args: Any, num_kv_heads_total: int, **kwargs: Any
                 ) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.num_kv_heads_total = num_kv_heads_total

    def run_model(self, inp: StepInputs, spans: list[tuple[int, torch.Tensor]],
                  marks: list[float], dev: DeviceStep | None = None) -> torch.Tensor | None:
        with collective(self.group, "a model step"):
            tensors = step_arrays(inp)
            if spans:
                tensors.append(torch.cat([e.to(self.dtype) for _, e in spans]))
            self.group.send(tp_wire.Forward(
                inp.max_query_len, [tp_wire.meta(t) for t in tensors],
                [row for row, _ in spans], [e.shape[0] for _, e in spans]), tensors)
            logits = super().run_model(inp, spans, marks, dev)
            if logits is None:
                return None
            parts = self.group.ctx.gather(logits)
            assert parts is not None
            return torch.cat(parts, dim=-1)  # [S, vocab]: rank r holds vocab slice r

    # -- KV blocks: the wire carries all heads, whatever the sizes of the two groups -------------
    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        bs, _, d = self.kv_caches[0][0].shape[1:]
        return (bs, self.num_kv_heads_total, d)

    def _owners(self) -> list[int]:
        """One rank per distinct KV-head slice (replicated heads: the first holder)."""
        replicas = max(1, self.group.size // self.num_kv_heads_total)
        return list(range(0, self.group.size, replicas))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        with collective(self.group, "reading KV blocks"):
            self.group.send(tp_wire.ReadKV(block_ids))
            parts = self.group.ctx.gather(local_blocks(self.kv_caches, block_ids))
            assert parts is not None
            return to_host(torch.cat([parts[r] for r in self._owners()], dim=4))

    # -- rank to rank (parallel/kv.py): groups of the same size ---------------------------
    def local_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[L, 2, n, block_size, rank 0's KV heads, D] host copy (its part of a transfer)."""
        return to_host(local_blocks(self.kv_caches, block_ids))

    def write_local(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write rank 0's heads of a rank-to-rank transfer."""
        ModelRunner.write_blocks(self, block_ids, kv)

    def send_slices(self, block_ids: list[int], peers: list[str], request_id: str,
                    first_block: int) -> bool:
        """Ranks 1..N-1 send their heads of these blocks to ``peers`` (the decode group's
        ranks 1..N-1); True when every one of them did."""
        with collective(self.group, "sending KV slices"):
            self.group.send(None, cmds=[tp_wire.SendKV(block_ids, peer, request_id, first_block)
                                        for peer in peers])
            oks = self.group.ctx.gather(self._ok())
        return all(int(t.item()) for t in oks[1:])

    def recv_slices(self, block_ids: list[int], request_id: str, first_block: int,
                    timeout_s: float) -> bool:
        """Ranks 1..N-1 take their slices of this transfer into ``block_ids``; True when
        every one of them did (a missing or malformed slice fails the transfer alone)."""
        cmd = tp_wire.RecvKV(block_ids, request_id, first_block, timeout_s)
        with collective(self.group, "receiving KV slices"):
            self.group.send(None, cmds=[cmd] * (self.group.size - 1))
            oks = self.group.ctx.gather(self._ok())
        return all(int(t.item()) for t in oks[1:])

    def _ok(self) -> torch.Tensor:
        return torch.tensor([1], device=self.kv_caches[0][0].device)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        # kv: [L, 2, n, block_size, all KV heads, D] -> each rank gets its heads
        local = self.kv_caches[0][0].shape[2]
        replicas = max(1, self.group.size // self.num_kv_heads_total)
        slices = [kv[:, :, :, :, r // replicas * local:(r // replicas + 1) * local]
                  for r in range(self.group.size)]
        with collective(self.group, "writing KV blocks"):
            self.group.send(None, cmds=[tp_wire.WriteKV(block_ids, tp_wire.meta(s))
                                        for s in slices[1:]],
                            per_rank=[[s] for s in slices[1:]])
            super().write_blocks(block_ids, slices[0])


def local_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]
                 ) -> torch.Tensor:
    """[L, 2, n, block_size, local KV heads, D] of these blocks, on the caches' device."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    return torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                        for k, v in kv_caches])


class TPEncoder:
    """Rank 0's vision-tower call (EncoderRunner's ``encode_fn``) for the whole group."""

    def __init__(self, group: TPGroup, model: Any, out_dim: int, dtype: torch.dtype) -> None:
        self.group, self.model = group, model
        self.out_dim, self.dtype = out_dim, dtype

    def __call__(self, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        grid_list = grid.tolist()
        with collective(g, "a vision-tower call"):
            if g.encoder_mode == "weights":  # every rank runs the whole batch on its weights
                g.send(tp_wire.Encode(grid_list, [], tp_wire.meta(pixels)), [pixels])
                return self.model.encode_images(pixels, grid)
            a = balance_by_patches(grid.prod(-1).tolist(), g.size)
            shares = [rank_pixels(pixels, grid, items) for items in a.ranks]
            g.send(None, cmds=[tp_wire.Encode(grid_list, a.ranks, tp_wire.meta(s))
                               for s in shares[1:]], per_rank=[[s] for s in shares[1:]])
            out = encode_data_parallel(self.model.encode_images, g.ctx, grid, a, shares[0],
                                       self.model.spatial_merge_size, self.out_dim, self.dtype)
            assert out is not None
            return out
