"""A tensor-parallel rank r > 0: ``python -m triptych.parallel.rank``, RankSpec as JSON on stdin.

Started by its group's rank 0 (parallel/group.py). It loads its shard of the parts of the
model its pool runs (``RankSpec.weight_parts``: the tower, the language model or both,
models/weight_parts.py), tells rank 0 the weight bytes it holds, (for an engine group)
allocates its heads' slice of the KV cache, then runs the commands rank 0 sends, joining
the same collectives in the same order:

    loop:  wait for a command (checking rank 0 is alive while idle)
           Forward -> ModelRunner.run_model on the step's arrays; logits slice to rank 0
           Encode  -> the vision tower (whole batch on its weights, or its share of items)
           ReadKV / WriteKV -> its heads of those KV blocks;  Stop -> exit 0

It keeps no request state. Any error (a failed collective, rank 0 gone, a bad command) ends
the process with status 1; rank 0 then fails too and the supervisor restarts the group.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any

import msgspec
import numpy as np

logger = logging.getLogger("triptych.tp")
IDLE_POLL_MS = 500


class _Orphaned(Exception):
    pass


def _die_with_parent(parent_pid: int) -> None:
    # NOTE: SIGKILL, not a handler: a rank holds nothing that needs cleaning up (rank 0
    # owns the group's directory), and a handler would not run inside a blocking collective.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        raise _Orphaned("rank 0 is gone")


def run_rank(spec: Any) -> None:
    import torch
    import torch.distributed as dist
    import zmq
    from triptych.config import EngineConfig
    from triptych.engine.sizing.memory import start_snapshot
    from triptych.engine.runner.model_runner import ModelRunner
    from triptych.engine.sizing.model_shape import (
        num_kv_blocks,
        resolve_cpu_weights,
        resolve_device,
    )
    from triptych.engine.sizing.profile_run import ProfileMeter, profile_blocks
    from triptych.kernels import get_ops
    from triptych.models import load_model
    from triptych.models.tp_plan import local_kv_heads
    from triptych.models.weight_parts import weight_bytes
    from triptych.parallel import wire as tp_wire
    from triptych.parallel.context import TPContext
    from triptych.parallel.group import (
        command_address,
        publish_weight_bytes,
        rank_device,
        store_path,
    )
    from triptych.parallel.loader import read_checkpoint
    from triptych.worker.threads import apply_thread_policy

    apply_thread_policy(max(1, spec.num_threads))
    config = EngineConfig(**spec.config)
    store = dist.FileStore(store_path(spec.run_dir), spec.size)
    kv_io = _rank_kv(spec, config)
    if kv_io is not None:  # published before joining: rank 0 reads it once all joined
        store.set(f"addr/{spec.rank}", kv_io.address)
    store.set(f"joined/{spec.rank}", "1")
    device = rank_device(resolve_device(config.device), spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = start_snapshot(config, spec.role, "", device)  # CUDA: refuses a share not free
    ctx = TPContext.connect(store, spec.rank, spec.size, device)
    _, dtype, backend, shape = read_checkpoint(config, device)  # as rank 0 read it
    model, _ = load_model(config.model, dtype, str(device), backend, tp=ctx,
                          shard_vision=spec.encoder_mode == "weights",
                          cpu_weights=resolve_cpu_weights(config, device),
                          parts=spec.weight_parts)
    held = weight_bytes(model)  # measured in this process: what it holds, not the plan
    publish_weight_bytes(store, spec.rank, held)
    runner = meter = None
    if spec.role == "engine":
        blocks = num_kv_blocks(config, shape, dtype, device, spec.size)
        if blocks is None:  # CUDA, sized by rank 0's profile run: measure ours (SizeKV)
            meter = ProfileMeter(device, start)
            meter.loaded()
        blocks = ctx.min_int(blocks or profile_blocks(config))
        runner = ModelRunner(model, None, num_blocks=blocks, block_size=config.block_size,
                             num_layers=shape.num_layers,
                             num_kv_heads=local_kv_heads(shape.num_kv_heads, spec.size),
                             head_dim=shape.head_dim, dtype=dtype, device=device,
                             ops=get_ops(backend), seed=config.seed)
        if meter is not None:
            meter.begin()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(command_address(spec.run_dir, spec.rank))
    logger.info("rank %d of %d ready (%s, vision tower: %s; weights: %s, vision %d bytes, "
                "language %d bytes)", spec.rank, spec.size, spec.role, spec.encoder_mode,
                spec.weight_parts, held["vision"], held["language"])
    try:
        with torch.inference_mode():
            while True:
                if not sock.poll(IDLE_POLL_MS):
                    if os.getppid() != spec.parent_pid:
                        raise _Orphaned("rank 0 is gone")
                    continue
                cmd, tensors = tp_wire.decode(sock.recv_multipart())
                if isinstance(cmd, tp_wire.Stop):
                    return
                if isinstance(cmd, tp_wire.SizeKV):
                    _size_kv(config, shape, dtype, spec.size, ctx, runner, meter)
                    continue
                execute(cmd, tensors, ctx, model, runner, shape, dtype, device, kv_io)
    finally:
        if kv_io is not None:
            kv_io.close()
        sock.close(0)
        zctx.term()
        ctx.close()


def _size_kv(config: Any, shape: Any, dtype: Any, size: int, ctx: Any, runner: Any,
             meter: Any) -> None:
    """SizeKV: the blocks this rank's share holds after what it measured, the group's
    smallest (rank 0 refuses below 2 blocks, naming the flag), allocated."""
    from triptych.engine.sizing.memory import kv_blocks_from_share
    from triptych.engine.sizing.model_shape import kv_block_bytes
    from triptych.models.tp_plan import local_kv_heads

    per_block = kv_block_bytes(shape, config.block_size, dtype,
                               local_kv_heads(shape.num_kv_heads, size))
    try:
        n = kv_blocks_from_share(int(meter.start.total * config.gpu_memory_utilization),
                                 meter.usage(), per_block, "--gpu-memory-utilization")
    except ValueError as e:
        logger.error("rank %d: %s", ctx.rank, e)
        n = 0
    n = ctx.min_int(n)
    if n >= 2:
        runner.allocate_kv_cache(n)


def _rank_kv(spec: Any, config: Any) -> Any:
    """This rank's KV endpoint (pool workers' groups), or None."""
    if not spec.data_kind or spec.role != "engine":
        return None
    from triptych.parallel.kv import RankKV

    keys = None
    if spec.data_kind == "tcp" and config.worker_keys and spec.key_name:
        from triptych.connector.auth import load_keys
        keys = load_keys(config.worker_keys, spec.key_name)
    name = f"{os.path.basename(spec.run_dir)}-r{spec.rank}"
    return RankKV(spec.data_kind, name, spec.rank, keys, config.kv_transfer_host)


def execute(cmd: Any, tensors: list[Any], ctx: Any, model: Any, runner: Any, shape: Any,
            dtype: Any, device: Any, kv_io: Any = None) -> None:
    """One command, with the same collectives rank 0 runs for it."""
    import torch
    from triptych.parallel.encoder_data import encode_data_parallel
    from triptych.parallel.patch_balance import PatchAssignment
    from triptych.parallel import wire as tp_wire
    from triptych.engine.runner.input_batch import StepInputs
    from triptych.parallel.runner import local_blocks

    if isinstance(cmd, tp_wire.Forward):
        arrays = dict(zip(tp_wire.STEP_ARRAYS, (t.numpy() for t in tensors)))
        inp = StepInputs(max_query_len=cmd.max_query_len, **arrays)
        spans = []
        if cmd.mm_rows:
            rows = tensors[len(tp_wire.STEP_ARRAYS)].to(device)
            spans = list(zip(cmd.mm_rows, rows.split(cmd.mm_lens)))
        logits = runner.run_model(inp, spans, [])
        if logits is not None:
            ctx.gather(logits)
    elif isinstance(cmd, tp_wire.Encode):
        pixels = tensors[0].to(device, dtype)
        grid = np.array(cmd.grid, dtype=np.int64)  # on the host (the tower's contract)
        if cmd.ranks:
            a = PatchAssignment(cmd.ranks, [])
            encode_data_parallel(model.encode_images, ctx, grid, a, pixels,
                                 model.spatial_merge_size, shape.payload_width, dtype)
        else:
            model.encode_images(pixels, grid)  # rank 0 keeps the (identical) result
    elif isinstance(cmd, tp_wire.ReadKV):
        ctx.gather(local_blocks(runner.kv_caches, cmd.block_ids))
    elif isinstance(cmd, tp_wire.WriteKV):
        runner.write_blocks(cmd.block_ids, tensors[0])
    elif isinstance(cmd, tp_wire.SendKV):  # rank to rank: no gather through rank 0
        data = local_blocks(runner.kv_caches, cmd.block_ids)
        ok = kv_io is not None and kv_io.send(cmd.peer, cmd.request_id, cmd.first_block, data)
        ctx.gather(torch.tensor([int(ok)], device=device))
    elif isinstance(cmd, tp_wire.RecvKV):
        data = kv_io.take(cmd.request_id, cmd.first_block, cmd.timeout_s) if kv_io else None
        k = runner.kv_caches[0][0]
        want = (len(runner.kv_caches), 2, len(cmd.block_ids), *k.shape[1:])
        ok = data is not None and tuple(data.shape) == want and data.dtype == k.dtype
        if ok:
            runner.write_blocks(cmd.block_ids, data)
        ctx.gather(torch.tensor([int(ok)], device=device))


def main() -> None:
    from triptych.parallel.group import RankSpec

    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=RankSpec)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[tp-rank{spec.rank}]: "
                               "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns shutdown
    code = 0
    try:
        _die_with_parent(spec.parent_pid)
        run_rank(spec)
    except _Orphaned as e:
        logger.info("rank stops: %s", e)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # NOTE: no interpreter finalization (torch pools, gloo threads)


if __name__ == "__main__":
    main()
