"""RayBackend: the router's pool workers as Ray actors (distributed_executor_backend=ray).

    P0 (Ray driver)                                 a node the placement group chose
    Router: ROUTER tcp://<P0 node>:<port>, CURVE  <--- DEALER, CURVE --- PoolWorkerActor
    Supervisor(launcher=RayBackend.launch)                              run_worker(spec)
      spawn: placement group (one bundle: the TP group) -> actor -> actor.run(spec)
      watch: RayProc.poll() = has the actor's run() call ended or failed (actor death,
             node loss: Ray's own notification), beside the heartbeat silence every
             worker is watched for

Each worker is a Ray actor (``router/ray_actor.py``) in a placement group of its own with
one bundle: the group's ranks (TP ranks are the actor's own subprocesses, so the group is
on one node: STRICT_PACK), one CPU per rank (one GPU per rank with --device cuda) plus the
pool's ``--<pool>-resources``. A restart is a new actor in a new placement group, so a
worker whose node is gone comes back on another node that has the resources. The data
path never touches Ray: workers send embeddings and KV to each other over the connector
(tcp + CURVE with the deployment's keys, made here at start and given to each actor as
arguments).

Nothing outlives the server: every actor and placement group is owned by P0's Ray job
(none detached), so Ray removes them if P0 is killed; a clean stop asks each worker to
stop (Shutdown on its socket), kills what is left, removes the placement groups and, if
this server started its own Ray, stops it; on a cluster that stays, ``close`` returns once
Ray shows every actor dead and every placement group removed. Placement groups are named
``triptych-<pid>-<engine tag>-<worker>``: engines one after another in one process (a
notebook, an evaluation script) never meet each other's names. A worker Ray cannot start
is a ClusterError naming it, after what it had made is released.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from triptych.config import EngineConfig
from triptych.connector.auth import Keys
from triptych.router.errors import ClusterError
from triptych.router.handle import WorkerHandle
from triptych.router.layout import Layout
from triptych.router.ray_proc import RayProc
from triptych.router.ray_reaper import note_session, reap_orphans
from triptych.worker.loop import WorkerSpec

logger = logging.getLogger("triptych.ray")
CHECK_CONNECT_S = 5.0  # an explicit cluster address must answer a TCP connect this fast
GONE_TIMEOUT_S = 30.0  # close waits this long at most for Ray to show actors and groups gone


def pool_bundle(config: EngineConfig, pool: str, tp: int) -> tuple[dict[str, float], int]:
    """(the one bundle a worker of ``pool`` asks Ray for, its torch threads)."""
    asked = dict(getattr(config, f"{'decode' if pool == 'colocated' else pool}_resources")
                 or {})
    cpu = float(asked.pop("CPU", 1))
    gpu = float(asked.pop("GPU", 1 if config.device == "cuda" else 0))
    bundle = {"CPU": cpu * tp, **({"GPU": gpu * tp} if gpu else {}), **asked}
    return bundle, max(1, int(cpu)) * tp


class RayBackend:
    def __init__(self, config: EngineConfig, layout: Layout) -> None:
        self.config = config
        self.layout = layout
        self.started_ray = False  # this server started the Ray it runs on (stop it at close)
        self.host = ""  # the address Ray knows P0's node by (the router socket binds it)
        self.keys: dict[str, bytes] = {}
        self.send_shutdown: Callable[[WorkerHandle], None] = lambda w: None
        self._pgs: dict[str, Any] = {}  # worker name -> its current placement group
        self._procs: dict[str, RayProc] = {}  # worker name -> its current actor
        self.tag = f"triptych-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this engine's names

    # -- start ----------------------------------------------------------------------------
    def connect(self) -> None:
        """Join (or start) Ray and check the cluster can hold every pool. One-line
        ClusterError otherwise."""
        import ray

        address = self.config.ray_address
        if address is None and os.environ.get("RAY_ADDRESS"):
            address = "auto"
        if ray.is_initialized() and address not in (None, "auto", "local"):
            joined = ray.get_runtime_context().gcs_address
            if address.removeprefix("ray://") != joined:
                raise ClusterError(f"this process is a driver of the Ray cluster at {joined} "
                                   f"already; it cannot join {address} (--ray-address)")
        if not ray.is_initialized():
            if address in (None, "local"):
                reap_orphans()
            if address not in (None, "auto", "local") and not address.startswith("ray://"):
                _check_reachable(address)
            elif address == "auto" and os.environ.get("RAY_ADDRESS", "").count(":") == 1:
                _check_reachable(os.environ["RAY_ADDRESS"])
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if address in (None, "local"):
                # NOTE: a Ray for this server alone: its CPUs are scheduling tokens, as many
                # as the workers ask (local processes oversubscribe the same way)
                need = sum(pool_bundle(self.config, p, self.layout.tp[p])[0]["CPU"] * n
                           for p, n in self.layout.pools.items())
                kw["num_cpus"] = max(int(need + 0.999), os.cpu_count() or 1)
            try:
                ray.init(address=address, **kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ClusterError(f"cannot join the Ray cluster at {address}: "
                                   f"{str(e).splitlines()[0]} (--ray-address)") from None
            self.started_ray = address in (None, "local")
        self.host = ray.util.get_node_ip_address()
        try:
            self.check_resources()
        except ClusterError:
            if self.started_ray:
                ray.shutdown()
            raise
        self.keys = dict(zip(("router_public", "router_secret"), zmq.curve_keypair()))
        self.keys.update(zip(("worker_public", "worker_secret"), zmq.curve_keypair()))
        logger.info("Ray backend: driver on %s, %d nodes%s", self.host,
                    len([n for n in ray.nodes() if n["Alive"]]),
                    " (started for this server)" if self.started_ray else "")

    def check_resources(self, pools: dict[str, int] | None = None) -> None:
        """Every worker's bundle must fit on the cluster's nodes (first fit on what the
        nodes offer in all); else a one-line ClusterError naming what is missing."""
        import ray

        free = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
        for pool, count in (pools or self.layout.pools).items():
            bundle, _ = pool_bundle(self.config, pool, self.layout.tp[pool])
            for i in range(count):
                node = next((n for n in free if all(n.get(k, 0.0) >= v - 1e-9
                                                    for k, v in bundle.items())), None)
                if node is None:
                    offered = sorted({k for n in free for k in n
                                      if not k.startswith("node:") and "memory" not in k})
                    knob = "decode" if pool == "colocated" else pool
                    raise ClusterError(
                        f"the Ray cluster cannot place {pool} worker {i + 1} of {count}: it "
                        f"asks {bundle} (--{knob}-resources; one CPU per rank) and no live "
                        f"node has that left (resources offered: {', '.join(offered)})")
                for k, v in bundle.items():
                    node[k] -= v

    def note_session(self, run_dir: str) -> None:
        """A Ray this server started: its session, noted for the next server (reaper)."""
        if self.started_ray:
            note_session(run_dir)

    def router_keys(self) -> tuple[Keys, list[bytes]]:
        """The router socket's keypair and the client keys it admits."""
        return (Keys("router", self.keys["router_public"], self.keys["router_secret"],
                     {"worker": self.keys["worker_public"]}), [self.keys["worker_public"]])

    # -- workers --------------------------------------------------------------------------
    def launch(self, w: WorkerHandle, spec: WorkerSpec) -> RayProc:
        """The supervisor's spawn for ``w``: a new placement group and actor (what the
        previous incarnation held is released first)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from triptych.router.ray_actor import PoolWorkerActor

        self.release(w.name)
        bundle, threads = pool_bundle(self.config, w.pool, self.layout.tp[w.pool])
        spec = msgspec.structs.replace(spec, num_threads=threads)
        wire_keys = {k: v for k, v in self.keys.items() if not k.startswith("router_s")}
        try:
            pg = ray.util.placement_group([bundle], strategy="STRICT_PACK",
                                          name=f"{self.tag}-{w.name}")
            self._pgs[w.name] = pg
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            actor = ray.remote(PoolWorkerActor).options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                resources=custom or None, max_restarts=0, max_concurrency=1, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0)).remote()
            node_ref = actor.node.remote()
            run_ref = actor.run.remote(msgspec.json.encode(spec), wire_keys)
        except Exception as e:  # noqa: BLE001 - Ray's own errors: a name taken, GCS gone
            self.release(w.name)
            raise ClusterError(f"Ray could not start worker {w.name}: "
                               f"{str(e).strip().splitlines()[0][:300]}") from None
        proc = RayProc(actor, run_ref, node_ref, w, lambda: self.send_shutdown(w))
        self._procs[w.name] = proc
        return proc

    def release(self, name: str) -> None:
        """Kill worker ``name``'s actor (if any) and remove its placement group."""
        import ray

        proc = self._procs.pop(name, None)
        if proc is not None:
            try:
                proc.kill()
            except Exception as e:  # noqa: BLE001 - gone with its node
                logger.debug("killing %s's actor: %s", name, e)
        pg = self._pgs.pop(name, None)
        if pg is not None:
            try:
                ray.util.remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001
                logger.debug("removing %s's placement group: %s", name, e)

    def close(self) -> None:
        """Every actor and placement group this server made, gone; Ray stopped if ours."""
        import ray

        if not ray.is_initialized():
            return
        procs, pgs = list(self._procs.values()), list(self._pgs.values())
        for name in list(self._procs) + list(self._pgs):
            self.release(name)
        pids = [p.settled_pid() for p in procs]  # (one killed before its hello too)
        if self.started_ray:
            ray.shutdown()
        else:  # the cluster stays: return once it shows nothing of ours (removal is async)
            _wait_gone(procs, pgs)
        _clean_after(pids)


def _wait_gone(procs: list[RayProc], pgs: list[Any], timeout: float = GONE_TIMEOUT_S
               ) -> None:
    """Until Ray's tables show each killed actor dead and each placement group removed
    (bounded; what is still there is logged)."""
    import ray
    from ray._private.state import actors  # NOTE: the GCS table: ray.util.state needs
    # the dashboard, which a cluster may run without

    deadline = time.monotonic() + timeout
    ids = [p.actor._actor_id.hex() for p in procs]
    while time.monotonic() < deadline:
        pgs = [pg for pg in pgs
               if ray.util.placement_group_table(pg).get("state") != "REMOVED"]
        ids = [i for i in ids if (actors(actor_id=i) or {}).get("State") != "DEAD"]
        if not pgs and not ids:
            return
        time.sleep(0.05)
    logger.warning("Ray still shows %d actors and %d placement groups of this engine %.0f s "
                   "after they were removed", len(ids), len(pgs), timeout)


def _clean_after(pids: list[int], timeout: float = 5.0) -> None:
    """Once the killed actors of this host have exited (bounded), remove their key dirs: a
    killed actor cannot, and each key dir is judged by the lock its actor held."""
    from triptych.router.supervisor import clean_stale

    deadline = time.monotonic() + timeout
    for pid in (p for p in pids if p > 0):
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)
    clean_stale()


def _check_reachable(address: str) -> None:
    """host:port must take a TCP connection within CHECK_CONNECT_S (Ray itself would
    retry for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CHECK_CONNECT_S):
            return
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot reach the Ray cluster at {address}: "
                           f"{e.strerror or type(e).__name__} (--ray-address, RAY_ADDRESS)"
                           ) from None


async def stop_gracefully(send: Callable[[], Any]) -> None:
    """Run one Shutdown send (a coroutine factory) on the event loop."""
    try:
        await send()
    except Exception as e:  # noqa: BLE001
        logger.debug("Shutdown not sent: %s", e)


def shutdown_sender(loop: asyncio.AbstractEventLoop, send: Callable[[WorkerHandle], Any]
                    ) -> Callable[[WorkerHandle], None]:
    """A callback that schedules ``send(worker)`` on ``loop`` (from the loop's thread or
    another one)."""
    def schedule(w: WorkerHandle) -> None:
        coro = stop_gracefully(lambda: send(w))
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(coro)
        else:
            asyncio.run_coroutine_threadsafe(coro, loop)
    return schedule
