"""The connector endpoint of a pool worker (its data plane), from the engine knobs.

kv_transfer=auto is shm while every worker is on this host, tcp once workers on other hosts
may register (worker_address set) and on those workers themselves. A tcp endpoint binds kv_transfer_host (loopback unless
the operator says otherwise) and, with worker_keys, speaks CURVE with the cluster's keys.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from triptych.config import EngineConfig
from triptych.worker import wire

if TYPE_CHECKING:
    from triptych.connector import Connector
    from triptych.worker.loop import WorkerSpec


def endpoint_kind(config: EngineConfig, spec: WorkerSpec) -> str:
    """The transport of this worker's endpoints (its own and its TP ranks')."""
    from triptych.connector import resolve_kind

    # One host unless workers on other hosts may join (the router opened worker_address),
    # or this is one of them (nobody here supervises it).
    same_host = config.worker_address is None and not spec.remote
    return resolve_kind(config.kv_transfer, same_host=same_host)


def key_name(spec: WorkerSpec) -> str:
    return spec.key_name or spec.worker_id.partition("#")[0]


def data_endpoint(config: EngineConfig, spec: WorkerSpec) -> Connector:
    from triptych.connector import make_connector

    kind = endpoint_kind(config, spec)
    keys = None
    if kind == "tcp" and config.worker_keys:
        from triptych.connector.auth import load_keys
        keys = load_keys(config.worker_keys, key_name(spec))
    return make_connector(kind, name=spec.worker_id.replace("#", "-"),
                          header_type=wire.DataMsg, keys=keys,
                          bind_host=config.kv_transfer_host)
