"""PoolWorkerActor: one pool worker as a Ray actor (distributed_executor_backend=ray).

The actor runs the same worker loop as a local process (``worker/loop.py`` ``run_worker``
with the pool's handler), in the actor's main thread; it only adapts the spec to where Ray
placed it:

    router address   tcp://<P0's node>:<port>, CURVE (the router's public key pinned)
    data endpoint    kv_transfer=tcp bound on this node's address, CURVE
    keys             the deployment's keypairs, given as actor arguments (never through a
                     shared place), written for this process alone to a 0700 dir in this
                     node's temp dir named triptych-<pid>-keys-*, removed at exit (or by the
                     next server's start once the pid is gone), so TP ranks and the
                     connector read them like `triptych keys` output
    parent check     none: the actor is owned by P0's Ray driver and Ray ends it when P0
                     goes (non-detached actors share their owner's fate)

Only small things cross Ray's control calls: the spec (JSON bytes) and the keys.
Nothing of the data path goes through Ray.
"""
from __future__ import annotations

import importlib
import os
import shutil
from typing import Any

WORKER_KEY = "worker"  # the name of every actor's key in its key dir (one deployment key)
HANDLERS = {"colocated": ("triptych.decode.worker", "make_worker"),
            "decode": ("triptych.decode.worker", "make_worker"),
            "prefill": ("triptych.prefill.worker", "PrefillWorker"),
            "encode": ("triptych.encode.worker", "EncodeWorker")}


def write_key_dir(keys: dict[str, bytes]) -> tuple[str, int]:
    """``keys``: router_public, worker_public, worker_secret (z85). A key dir in the layout
    of ``triptych keys`` (private 0700 / 0600), readable by this user only; (its path, the
    lock fd this process holds while it lives: connector/owner.py, so that a killed actor's
    dir is judged dead at once by the next stale cleanup on this node)."""
    from triptych.connector.owner import make_owned_dir

    path, lock = make_owned_dir(f"triptych-{os.getpid()}-keys-")  # 0700
    os.makedirs(os.path.join(path, "private"), mode=0o700)
    os.makedirs(os.path.join(path, "public"), mode=0o755)

    def cert(public: bytes, secret: bytes | None) -> str:
        lines = ["metadata", "curve", f'    public-key = "{public.decode()}"']
        if secret is not None:
            lines.append(f'    secret-key = "{secret.decode()}"')
        return "\n".join(lines) + "\n"

    secret_file = os.path.join(path, "private", f"{WORKER_KEY}.key_secret")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cert(keys["worker_public"], keys["worker_secret"]))
    for name, public in (("router", keys["router_public"]),
                         (WORKER_KEY, keys["worker_public"])):
        with open(os.path.join(path, "public", f"{name}.key"), "w") as f:
            f.write(cert(public, None))
    return path, lock


class PoolWorkerActor:
    """Created by ``router/ray_backend.py``; ``node()`` first, then ``run()`` (which holds
    the actor until the worker stops)."""

    def node(self) -> dict[str, str]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": str(os.getpid())}

    def run(self, spec_json: bytes, keys: dict[str, bytes]) -> int:
        import msgspec
        import ray
        from triptych.connector import cleanup_stale
        from triptych.router.supervisor import clean_stale
        from triptych.worker.threads import thread_env

        clean_stale()  # key dirs and run dirs of dead processes on this node
        cleanup_stale()
        from triptych.worker.loop import WorkerSpec, run_worker

        spec = msgspec.json.decode(spec_json, type=WorkerSpec)
        # NOTE: before torch loads in this process (the OpenMP wait policy is read then)
        os.environ.update(thread_env(spec.num_threads, os.environ))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(spec.num_threads)
        key_dir, key_lock = write_key_dir(keys)
        try:
            config: dict[str, Any] = dict(spec.config, kv_transfer="tcp",
                                          kv_transfer_host=ray.util.get_node_ip_address(),
                                          worker_keys=key_dir)
            spec = msgspec.structs.replace(spec, config=config, key_name=WORKER_KEY,
                                           parent_pid=0)
            module, name = HANDLERS[spec.pool]
            run_worker(spec, getattr(importlib.import_module(module), name))
            return 0
        finally:
            shutil.rmtree(key_dir, ignore_errors=True)
            os.close(key_lock)
