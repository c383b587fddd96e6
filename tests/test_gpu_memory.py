"""GPU memory sizing as numbers (engine/sizing/memory.py), the pools' shares of one GPU
(router/layout.py GpuShares) and workers sharing a device starting in turn
(router/supervisor.py). Everything here runs on the CPU: CUDA appears only as a device name
(``torch.device("cuda")`` touches no GPU)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from triptych.config import EngineConfig
from triptych.engine.sizing.memory import (
    GIB,
    MemorySnapshot,
    Usage,
    blocks_for,
    encode_share,
    explicit_kv_bytes,
    kv_blocks_from_share,
    requested_bytes,
    share_flag,
    usage_after_profile,
)
from triptych.engine.sizing.model_shape import ModelShape, kv_block_bytes, num_kv_blocks
from triptych.router.handle import WorkerHandle
from triptych.router.layout import GpuShares, Layout
from triptych.router.supervisor import Supervisor

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
# 28 layers, 2 KV heads of 128: Qwen2-VL-2B's language model
SHAPE = ModelShape(num_layers=28, num_kv_heads=2, head_dim=128, max_position_embeddings=32768,
                   spatial_merge_size=2, tokens_per_second=None, image_token_id=5,
                   video_token_id=6, vocab_size=151936, hidden_size=1536, payload_width=1536)


def cfg(**kw) -> EngineConfig:
    return EngineConfig(model="m", **kw)


def test_share_must_be_free_and_the_refusal_names_the_flag():
    snap = MemorySnapshot(free=40 * GIB, total=80 * GIB)
    assert requested_bytes(snap, 0.45, "--gpu-memory-utilization") == int(36 * GIB)
    with pytest.raises(ValueError, match="--gpu-memory-utilization") as e:
        requested_bytes(snap, 0.9, "--gpu-memory-utilization")  # vLLM's rule: 72 > 40 free
    assert "\n" not in str(e.value) and "40.00 GiB free of 80.00 GiB" in str(e.value)
    # the flag that set this worker's share
    assert share_flag(cfg(), "") == "--gpu-memory-utilization"
    assert share_flag(cfg(decode_workers=1), "decode") == "--gpu-memory-utilization"
    assert share_flag(cfg(decode_workers=1, decode_gpu_memory_utilization=0.5), "decode") \
        == "--decode-gpu-memory-utilization"


def test_kv_is_the_share_less_weights_peak_non_torch_and_encoder_cache():
    # start: 2 GiB used by others/context; after: 3 GiB more outside torch (cuBLAS, NCCL)
    start = MemorySnapshot(free=78 * GIB, total=80 * GIB, torch_reserved=0)
    after = MemorySnapshot(free=60 * GIB, total=80 * GIB, torch_reserved=15 * GIB)
    usage = usage_after_profile(start, weights=4 * GIB, before_profile=5 * GIB,
                                peak_allocated=12 * GIB, after=after, encoder_cache=GIB)
    assert usage == Usage(weights=4 * GIB, peak_activation=7 * GIB, non_torch=3 * GIB,
                          encoder_cache=GIB)
    per_block = kv_block_bytes(SHAPE, 16, torch.bfloat16)
    assert per_block == 2 * 28 * 16 * 2 * 128 * 2  # K and V, every layer
    requested = int(80 * GIB * 0.45)  # 36 GiB
    assert kv_blocks_from_share(requested, usage, per_block, "--x") == \
        (requested - 15 * GIB) // per_block
    with pytest.raises(ValueError, match="leaves no room.*raise --decode-gpu"):
        kv_blocks_from_share(15 * GIB, usage, per_block, "--decode-gpu-memory-utilization")
    with pytest.raises(ValueError, match="holds no blocks"):
        blocks_for(per_block + 1, per_block, "kv_cache_memory")
    # an encode worker's share: its need, rounded up to 0.001 of the device
    assert encode_share(Usage(GIB, GIB, 0, GIB // 4), 80 * GIB) == 0.029


def test_kv_cache_memory_and_num_kv_blocks_need_no_profile():
    assert explicit_kv_bytes(cfg(), "cpu") == GIB  # the CPU default, as before
    assert explicit_kv_bytes(cfg(), "cuda") is None  # CUDA: a profile run sizes it
    assert explicit_kv_bytes(cfg(kv_cache_memory="2GiB"), "cuda") == 2 * GIB
    per_block = kv_block_bytes(SHAPE, 16, torch.float32)
    assert num_kv_blocks(cfg(), SHAPE, torch.float32, CPU) == GIB // per_block
    assert num_kv_blocks(cfg(), SHAPE, torch.float32, CUDA) is None
    assert num_kv_blocks(cfg(kv_cache_memory="2GiB"), SHAPE, torch.float32, CUDA) == \
        2 * GIB // per_block
    assert num_kv_blocks(cfg(num_kv_blocks=7), SHAPE, torch.float32, CUDA) == 7


def test_tensor_parallel_budgets():
    # CUDA: each rank's device has the whole budget for its half of the heads
    half = kv_block_bytes(SHAPE, 16, torch.float32, num_kv_heads=1)
    assert num_kv_blocks(cfg(kv_cache_memory="1GiB"), SHAPE, torch.float32, CUDA, 2) == \
        GIB // half
    # the CPU: the ranks share the host, so the budget is the group's
    assert num_kv_blocks(cfg(), SHAPE, torch.float32, CPU, 2) == GIB // (2 * half)
    # 4 ranks over 2 KV heads: heads replicate, every rank holds one head per block
    assert num_kv_blocks(cfg(kv_cache_memory="1GiB"), SHAPE, torch.float32, CUDA, 4) == \
        GIB // half


def test_pool_shares_of_one_gpu():
    e_p_d = GpuShares({"encode": 1, "prefill": 1, "decode": 1}, 0.9)
    assert e_p_d.shares() == {"encode": 0.0, "prefill": 0.45, "decode": 0.45}
    # once the encode worker measured its need, prefill and decode split what it leaves
    assert e_p_d.shares(0.05) == {"encode": 0.05, "prefill": 0.425, "decode": 0.425}
    assert e_p_d.share("encode", 0.05) is None  # it measures its own
    assert GpuShares({"encode": 2, "decode": 1}, 0.9).share("decode", 0.1) == 0.7
    # per-pool overrides; the pools without one split the rest
    pd = GpuShares({"prefill": 1, "decode": 2}, 0.9, {"prefill": 0.3})
    assert pd.shares() == {"prefill": 0.3, "decode": 0.3}
    with pytest.raises(ValueError, match="must sum to at most 1") as e:
        GpuShares({"prefill": 1, "decode": 1}, 0.9, {"prefill": 0.5, "decode": 0.6}).shares()
    assert "prefill 1 x 0.5, decode 1 x 0.6" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="leave nothing of --gpu-memory-utilization 0.9 for "
                                         "the prefill and decode workers"):
        e_p_d.shares(0.95)
    with pytest.raises(ValueError, match="must sum to at most 1"):
        GpuShares({"encode": 1, "decode": 1}, 0.9, {"encode": 0.6, "decode": 0.6}).shares()


def test_layout_gives_each_worker_its_share():
    def lay(**kw) -> Layout:
        return Layout.from_config(cfg(device="cuda", **kw))
    one = lay()
    assert one.gpu is None and one.worker_knobs("colocated") == {"tensor_parallel_size": 1}
    epd = lay(encode_workers=1, prefill_workers=1, decode_workers=1)
    assert epd.gpu is not None and epd.kv_cache_memory == {}  # CUDA: profiled, not 1GiB
    assert epd.worker_knobs("encode") == {"tensor_parallel_size": 1}
    assert epd.worker_knobs("decode") == {"tensor_parallel_size": 1,
                                          "gpu_memory_utilization": 0.45}
    assert lay(data_parallel_size=3).worker_knobs("colocated")["gpu_memory_utilization"] == 0.3
    given = lay(prefill_workers=1, decode_workers=1, kv_cache_memory="4GiB",
                decode_gpu_memory_utilization=0.6)
    assert given.kv_cache_memory == {"prefill": 4 * GIB, "decode": 4 * GIB}
    assert given.gpu_memory_utilization == {"prefill": 0.3, "decode": 0.6}
    with pytest.raises(ValueError, match="must sum to at most 1"):
        lay(prefill_workers=1, decode_workers=1, prefill_gpu_memory_utilization=0.5,
            decode_gpu_memory_utilization=0.6)
    # the CPU keeps its KV budgets and never splits a GPU
    cpu = Layout.from_config(cfg(device="cpu", encode_workers=1, prefill_workers=1,
                                 decode_workers=1))
    assert cpu.gpu is None and cpu.gpu_memory_utilization == {}
    assert cpu.kv_cache_memory == {"prefill": 512 << 20, "decode": GIB}


def test_share_knobs_are_checked():
    with pytest.raises(ValueError, match="decode_gpu_memory_utilization needs decode_workers"):
        cfg(decode_gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        cfg(decode_workers=1, decode_gpu_memory_utilization=0.0)


def _sleeper(w: WorkerHandle, spec) -> subprocess.Popen:
    """A stand-in process for the worker (the launcher hook Ray uses): the test plays the
    worker's hello by calling the handle's own on_hello, as the router's intake does."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _stop(sup: Supervisor) -> None:
    sup.kill_all_now()
    for w in sup.workers:
        if w.proc is not None:
            w.proc.wait(10)


def _workers(layout: Layout) -> list[WorkerHandle]:
    base = {"model": "m", "gpu_memory_utilization": 0.9}
    return [WorkerHandle(p, i, dict(base, **layout.worker_knobs(p)))
            for p, n in layout.pools.items() for i in range(n)]


def test_workers_sharing_a_gpu_start_in_turn_and_get_their_share():
    layout = Layout.from_config(cfg(device="cuda", encode_workers=1, prefill_workers=1,
                                    decode_workers=1))
    sup = Supervisor("ipc://unused", None, lambda w, code: None, launcher=_sleeper,
                     gpu=layout.gpu)
    enc, pre, dec = ws = _workers(layout)
    try:
        for w in ws:
            sup.spawn(w)
        assert enc.proc is not None and [pre.state, dec.state] == ["waiting", "waiting"]
        sup.check(0.0)
        assert pre.proc is None  # the encode worker has not said hello yet
        enc.on_hello({"gpu_memory_share": 0.1})
        sup.check(0.1)
        assert pre.proc is not None and dec.proc is None
        assert pre.config["gpu_memory_utilization"] == 0.4  # (0.9 - 0.1) / 2
        pre.on_hello({})
        sup.check(0.2)
        assert dec.proc is not None and dec.config["gpu_memory_utilization"] == 0.4
    finally:
        _stop(sup)


def test_cpu_workers_start_at_once():
    layout = Layout.from_config(cfg(device="cpu", encode_workers=1, prefill_workers=1,
                                    decode_workers=1))
    sup = Supervisor("ipc://unused", None, lambda w, code: None, launcher=_sleeper,
                     gpu=layout.gpu)
    ws = _workers(layout)
    try:
        for w in ws:
            sup.spawn(w)
        assert all(w.proc is not None and w.state == "starting" for w in ws)
        assert all("gpu_memory_utilization" not in layout.worker_knobs(w.pool) for w in ws)
    finally:
        _stop(sup)


def test_decode_workers_beside_a_prefill_pool_budget_no_encoder_or_tower():
    """A decode worker of P+D imports its requests' KV: it never runs the vision tower nor
    fills an encoder cache, so its KV sizing takes neither out of its share."""
    from types import SimpleNamespace

    from triptych.parallel.loader import _profile_image, decodes_only

    pd = EngineConfig(model="m", prefill_workers=1, decode_workers=1)
    epd = EngineConfig(model="m", encode_workers=1, decode_workers=1)
    assert decodes_only(pd, "decode") and not decodes_only(pd, "prefill")
    assert not decodes_only(epd, "decode")  # E+PD: its decode workers prefill too
    m = SimpleNamespace(weight_parts="all")
    assert _profile_image(pd, m, "decode") is None
