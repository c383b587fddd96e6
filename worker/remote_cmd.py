"""`triptych worker`: a pool worker on another host, registering with a remote router.

    triptych keys /etc/triptych/keys --names router,decode-h2      # once, on any host
    triptych serve ... --decode-workers 1 --kv-transfer tcp --kv-transfer-host 10.0.0.1 \\
        --worker-address tcp://10.0.0.1:7070 --worker-keys /etc/triptych/keys
    triptych worker --pool decode --name decode-h2 --router tcp://10.0.0.1:7070 \\
        --model /models/Qwen2-VL-2B-Instruct --kv-transfer tcp --kv-transfer-host 10.0.0.2 \\
        --worker-keys /etc/triptych/keys

The worker authenticates with the key named --name (CURVE); the router admits only keys in
its key directory and checks that the name matches the key. Same model and block size on
every host (the decode side checks the KV layout of every transfer). The worker is not
supervised by the router: run it under your init system; it stops when the router has not
taken a message for 30 s.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

POOLS = {"encode": ("triptych.encode.worker", "EncodeWorker"),
         "prefill": ("triptych.prefill.worker", "PrefillWorker"),
         "decode": ("triptych.decode.worker", "DecodeWorker")}


def add_parser(subparsers: Any) -> None:
    from triptych.cli import add_engine_args

    p = subparsers.add_parser(
        "worker", help="a pool worker on another host (registers with a router over CURVE)",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pool", required=True, choices=sorted(POOLS), help="the pool it joins")
    p.add_argument("--name", required=True,
                   help="its node name: the name of its key in --worker-keys")
    p.add_argument("--router", required=True,
                   help="the router's registration address (serve's --worker-address)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: all cores of this host)")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    import importlib

    from transformers import AutoTokenizer
    from triptych.cli import engine_config_from_args
    from triptych.worker.loop import WorkerSpec, run_worker

    config = engine_config_from_args(args)
    if not config.worker_keys:
        raise SystemExit("triptych worker: --worker-keys is required (the router admits "
                         "CURVE-authenticated workers only)")
    tok = AutoTokenizer.from_pretrained(config.tokenizer or config.model, local_files_only=True)
    import dataclasses
    spec = WorkerSpec(worker_id=f"{args.name}#{os.getpid()}", pool=args.pool,
                      router_address=args.router, config=dataclasses.asdict(config),
                      eos_token_id=tok.eos_token_id, parent_pid=0,
                      num_threads=args.threads or os.cpu_count() or 1, key_name=args.name,
                      remote=True)
    module, cls = POOLS[args.pool]
    run_worker(spec, getattr(importlib.import_module(module), cls))
    return 0
