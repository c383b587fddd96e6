"""TPGroup: rank 0 of a tensor-parallel worker group starts, drives and watches ranks 1..N-1.

    supervisor --spawns--> worker process = rank 0 (scheduler, worker loop, sampling)
                              |-- spawns --> python -m triptych.parallel.rank  (rank r,
                              |              RankSpec as JSON on stdin, nothing pickled)
                              |-- each step: a command (parallel/wire.py) over a ZMQ PUSH
                              |              socket per rank, ipc in a private 0700 dir
                              '-- all ranks: the same collectives (gloo / NCCL), each with
                                             a timeout (parallel/context.py)

Failure, both ways, so the supervisor restarts the whole group and the router moves or
fails its requests:
- rank 0 dies: each rank gets SIGKILL from the kernel (parent-death signal) and also
  checks its parent while idle; a rank inside a collective sees the connection close.
- a rank dies: rank 0's next collective fails at once; while idle, a watcher thread sees
  the exit and raises ``TPGroupError`` in rank 0's main thread (SIGUSR2), so the worker
  exits with an error instead of waiting for work.

The group's rendezvous file and sockets live in ``<tmp>/triptych-<rank 0 pid>-ipc-tp-*``,
removed at close, and by ``connector.cleanup_stale`` when rank 0 was killed.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq
from triptych.connector.owner import make_owned_dir, release
from triptych.parallel import wire as tp_wire
from triptych.worker.threads import apply_thread_policy, divide_cores, thread_env
from triptych.parallel.context import TPContext, TPGroupError

logger = logging.getLogger("triptych.tp")
JOIN_TIMEOUT_S = 120.0  # ranks import torch and join the rendezvous within this
LOAD_TIMEOUT_S = 600.0  # ranks read their shard of the checkpoint within this (hang guard)
WATCH_INTERVAL_S = 0.2
SEND_TIMEOUT_MS = 30_000  # a rank takes commands as fast as rank 0 sends them


class RankSpec(msgspec.Struct, kw_only=True):
    """What rank 0 tells a rank process (JSON on its stdin)."""

    rank: int
    size: int
    run_dir: str  # the group's private dir: rendezvous file and command sockets
    config: dict[str, Any]  # EngineConfig keyword arguments (as rank 0's)
    role: str  # engine (model + KV cache) | encode (vision tower only is used)
    encoder_mode: str  # weights | data (resolved by rank 0)
    weight_parts: str = "all"  # all | vision | language: what every rank builds and reads
    # (models/weight_parts.py), as rank 0 chose it for its pool
    parent_pid: int  # rank 0: exit when it is gone
    num_threads: int = 1  # torch intra-op threads of this rank
    data_kind: str = ""  # a pool worker's group: each rank's KV endpoint (shm | tcp), rank
    # to rank with a group of the same size (parallel/kv.py); "": none
    key_name: str | None = None  # CURVE key of the worker (tcp across hosts)


def store_path(run_dir: str) -> str:
    return os.path.join(run_dir, "store")


def command_address(run_dir: str, rank: int) -> str:
    return f"ipc://{run_dir}/rank{rank}"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One device per rank on GPU boxes (rank r on cuda:r); the CPU is shared."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TPGroup:
    """Rank 0's handle on its group: ``ctx`` for collectives, ``send`` for commands."""

    def __init__(self, config: dict[str, Any], size: int, role: str, encoder_mode: str,
                 device: torch.device, num_threads: int | None = None, data_kind: str = "",
                 key_name: str | None = None, weight_parts: str = "all") -> None:
        self.size, self.role, self.encoder_mode = size, role, encoder_mode
        self.weight_parts = weight_parts
        self.rank_addresses: list[str] = []  # ranks 1..N-1's KV endpoints (data_kind set)
        self.broken: str | None = None
        self._closing = self._raised = False
        self.procs: list[subprocess.Popen] = []
        self.run_dir, self._dir_lock = make_owned_dir(f"triptych-{os.getpid()}-ipc-tp-")
        self._zmq = zmq.Context()
        self._socks: list[zmq.Socket] = []
        self.ctx: TPContext | None = None
        try:
            # Rank 0's own share of this worker's cores is set here; each rank gets its own.
            threads = divide_cores(size, num_threads or torch.get_num_threads())
            apply_thread_policy(threads[0])
            for r in range(1, size):
                sock = self._zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
                sock.bind(command_address(self.run_dir, r))
                self._socks.append(sock)
            for r in range(1, size):
                self._spawn(RankSpec(rank=r, size=size, run_dir=self.run_dir, config=config,
                                     role=role, encoder_mode=encoder_mode,
                                     weight_parts=weight_parts,
                                     parent_pid=os.getpid(), num_threads=threads[r],
                                     data_kind=data_kind, key_name=key_name))
            self._store = store = dist.FileStore(store_path(self.run_dir), size)
            self._wait_for(store, "joined", JOIN_TIMEOUT_S, "start")
            if data_kind:  # each rank published its endpoint before it joined
                self.rank_addresses = [store.get(f"addr/{r}").decode() for r in range(1, size)]
            self.ctx = TPContext.connect(store, 0, size, rank_device(device, 0))
            self._watch()
        except BaseException:
            self.close()
            raise
        logger.info("tensor-parallel group of %d ranks (%s, vision tower: %s, parts: %s), "
                    "rank pids %s", size, role, encoder_mode, weight_parts,
                    [p.pid for p in self.procs])

    # -- start ------------------------------------------------------------------------------
    def _spawn(self, spec: RankSpec) -> None:
        env = thread_env(spec.num_threads, os.environ)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(spec.num_threads)
        p = subprocess.Popen([sys.executable, "-m", "triptych.parallel.rank"],
                             stdin=subprocess.PIPE, env=env)
        self.procs.append(p)
        assert p.stdin is not None
        p.stdin.write(msgspec.json.encode(spec))
        p.stdin.close()

    def _wait_for(self, store: Any, key: str, timeout_s: float, what: str) -> None:
        """Every rank wrote ``key/<rank>`` in the rendezvous file (polled, so a rank that
        died on the way fails this at once instead of after the timeout)."""
        keys = [f"{key}/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise TPGroupError(f"tensor-parallel ranks did not {what} in {timeout_s:.0f} s")
            time.sleep(0.05)

    def rank_weight_bytes(self) -> list[dict[str, int]]:
        """Ranks 1..N-1's resident weight bytes per part, as each measured its own model
        once loaded (``publish_weight_bytes``); waits for their loads."""
        self._wait_for(self._store, "weights", LOAD_TIMEOUT_S, "load their weights")
        return [msgspec.json.decode(self._store.get(f"weights/{r}"), type=dict[str, int])
                for r in range(1, self.size)]

    def _raise_if_dead(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise TPGroupError(f"tensor-parallel rank {r} (pid {p.pid}) exited with "
                                   f"{p.returncode}")

    # -- watching ---------------------------------------------------------------------------
    def _watch(self) -> None:
        self._main = threading.main_thread().ident
        self._on_main = threading.current_thread() is threading.main_thread()
        if self._on_main:
            self._old_handler = signal.signal(signal.SIGUSR2, self._on_rank_death)
        threading.Thread(target=self._watch_loop, daemon=True, name="triptych-tp-watch").start()

    def _watch_loop(self) -> None:
        while not self._closing:
            try:
                self._raise_if_dead()
            except TPGroupError as e:
                if self._closing or self.broken:  # closing, or the main thread knows
                    return
                self.broken = str(e)
                logger.error("%s: the group stops", e)
                if self._on_main:
                    signal.pthread_kill(self._main, signal.SIGUSR2)
                return
            time.sleep(WATCH_INTERVAL_S)

    def _on_rank_death(self, signum: int, frame: Any) -> None:
        if self._closing or self._raised:  # already failing: let that error unwind
            return
        self._raised = True
        raise TPGroupError(self.broken or "a tensor-parallel rank died")

    def mark_broken(self, reason: str) -> None:
        """The main thread saw the group fail (and raises TPGroupError itself)."""
        self.broken = self.broken or reason
        self._raised = True

    def check(self) -> None:
        """Raise if a rank is known dead (cheap: set by the watcher)."""
        if self.broken:
            raise TPGroupError(self.broken)

    # -- commands ---------------------------------------------------------------------------
    def send(self, cmd: tp_wire.Command, tensors: list[Any] = (),
             per_rank: list[list[Any]] | None = None, cmds: list[Any] | None = None) -> None:
        """Send a command to every rank: the same one, or ``cmds[r-1]`` with ``per_rank[r-1]``
        tensors to rank r. Raises TPGroupError when a rank cannot take it."""
        self.check()
        try:
            if cmds is None:
                frames = tp_wire.encode(cmd, tensors)
                for sock in self._socks:
                    sock.send_multipart(frames, copy=False)
            else:
                for sock, c, ts in zip(self._socks, cmds, per_rank or [[]] * len(cmds)):
                    sock.send_multipart(tp_wire.encode(c, ts), copy=False)
        except zmq.ZMQError as e:
            raise TPGroupError(f"a tensor-parallel rank takes no commands: {e}") from e

    # -- stop -------------------------------------------------------------------------------
    def close(self, grace_s: float = 5.0) -> None:
        """Stop the ranks (Stop, then SIGKILL after ``grace_s``), release everything."""
        if self._closing:
            return
        self._closing = True
        if self.broken is None:
            for sock in self._socks:
                try:
                    sock.send_multipart(tp_wire.encode(tp_wire.Stop()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + (grace_s if self.broken is None else 0.0)
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        if self.ctx is not None:
            self.ctx.close()
        for sock in self._socks:
            sock.close(0)
        self._zmq.term()
        if getattr(self, "_on_main", False):
            signal.signal(signal.SIGUSR2, self._old_handler)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        release(self._dir_lock)


def publish_weight_bytes(store: Any, rank: int, held: dict[str, int]) -> None:
    """Rank ``rank`` (> 0) tells rank 0 the weight bytes it holds (JSON in the store)."""
    store.set(f"weights/{rank}", msgspec.json.encode(held))


def start_group(config: Any, hf: Any, role: str, device: torch.device, data_kind: str = "",
                key_name: str | None = None, weight_parts: str = "all") -> TPGroup | None:
    """Rank 0's group for ``config.tensor_parallel_size`` > 1 (None for one process), after
    checking that the model (the ``weight_parts`` every rank loads) splits that many ways
    (ValueError naming the sizes). ``data_kind``: give each rank a KV endpoint of that
    transport (pool workers)."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    import dataclasses

    from triptych.models.registry import resolve_model_class
    from triptych.models.tp_plan import check_tp_sizes, resolve_encoder_mode

    mode = resolve_encoder_mode(resolve_model_class(getattr(hf, "architectures", None)),
                                config.mm_encoder_tp_mode, size)
    check_tp_sizes(hf, size, mode, weight_parts)
    return TPGroup(dataclasses.asdict(config), size, role, mode, device, data_kind=data_kind,
                   key_name=key_name, weight_parts=weight_parts)
