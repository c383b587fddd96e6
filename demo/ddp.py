"""Data-parallel training of the demo model over local processes (``--procs``; demo/train.py).

On a 2-core box two processes of one thread each make a step in less time than one
process of two threads: the model's ops are small, so a second OpenMP thread inside each
op gains little, while a second process keeps the other core busy all the time
(docs/demo-model.md has the figures). Rank 0 is the command itself: it prepares the
checkpoint directory, starts the other ranks as ``python -m triptych.demo.train`` with the
same flags (arguments on a command line; nothing pickled), and alone logs, saves and
evaluates. The ranks start from the same weights (broadcast from rank 0). Each draws every
step's samples and prompts from the one seeded stream a single process draws and keeps
its share (rank r the r-th slice), so together they train on one process's samples. Each
scales its two mean losses (the language model's, the glyph teacher's) by its share of
the step's label tokens and glyph targets (``token_shares``), and the gradients are
averaged over gloo on 127.0.0.1 after every backward: the result is the gradient one
process takes over the whole batch (a plain mean of the ranks' means was 0.3-0.5% of its
norm away on phase-1 batches), and every rank holds the same weights at every step. On
one machine a run is deterministic: adding two ranks' gradients is exact in either order.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Any

# A peer that waits longer than this for the others (one crashed, or rank 0 evaluates)
# gives up with an error instead of hanging.
TIMEOUT = timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command_line(args: argparse.Namespace) -> list[str]:
    """The flags that give ``args`` back when parsed (every option is ``--name``)."""
    out: list[str] = []
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


def start_peers(args: argparse.Namespace) -> list[subprocess.Popen]:
    """Ranks 1..procs-1 of this run, as child processes, on ``args.dist_port``."""
    peers = []
    for rank in range(1, args.procs):
        ns = argparse.Namespace(**{**vars(args), "rank": rank, "recipe": False})
        peers.append(subprocess.Popen([sys.executable, "-m", "triptych.demo.train",
                                       *command_line(ns)], stdout=subprocess.DEVNULL))
    return peers


def join(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.dist_port}",
                            rank=args.rank, world_size=args.procs, timeout=TIMEOUT)


def same_start(params: list[Any]) -> None:
    """Every rank takes rank 0's values (weights and the glyph head)."""
    import torch.distributed as dist

    for p in params:
        dist.broadcast(p.data, 0)


def counts(batch: dict[str, Any], targets: Any) -> list[int]:
    """The tokens a step's two mean losses average over: label tokens (the language
    model's loss shifts labels by one) and glyph-teacher slots that hold a target."""
    return [int((batch["labels"][:, 1:] != -100).sum()), int((targets != -100).sum())]


def token_shares(local: list[int], world: int) -> list[float]:
    """This rank's counts over every rank's, times the ranks: scaling each mean loss by its
    share before ``average_grads`` gives the gradient of the mean over all the step's tokens."""
    import torch
    import torch.distributed as dist

    total = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(total)
    return shares(local, total.tolist(), world)


def shares(local: list[int], total: list[float], world: int) -> list[float]:
    """``local`` over ``total`` (every rank's counts added), times the ranks."""
    return [n * world / max(1.0, t) for n, t in zip(local, total)]


def average_grads(params: list[Any], world: int) -> None:
    """One all-reduce of every gradient, flattened, then divided by the ranks."""
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n


def finish(peers: list[subprocess.Popen], ok: bool) -> None:
    """Rank 0: the peers end with the loop; on an error they are stopped, not left behind."""
    import torch.distributed as dist

    for p in peers:
        if not ok:
            p.kill()
        try:
            rc = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        if ok and rc != 0:
            raise RuntimeError(f"training rank exited with status {rc}")
    if dist.is_initialized():
        dist.destroy_process_group()
