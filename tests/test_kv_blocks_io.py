"""KV blocks by id (engine/runner/model_runner.py read_blocks / write_blocks): what a prefill
worker exports and a decode worker imports, through the import staging's one buffer.

On the CPU the staging packs too when asked (the GPU's layout: ids and blocks in one
buffer, typed views of it), so the packing is held here; on a GPU (the CUDA-only test) the
import must not synchronise the host at all (pinned buffer, non-blocking copy) and the
export must give the same bytes back.
"""
from __future__ import annotations

import pytest
import torch
from triptych import LLM
from triptych.engine.device.device_io import StepStaging


def _round_trip(runner, gen) -> None:
    k = runner.kv_caches[0][0]
    n_blocks = k.shape[0]
    ids = torch.randperm(n_blocks, generator=gen)[:5].tolist()
    # a strided view (what a transport may hand over): its bytes are packed, not assumed
    kv = torch.randn((len(runner.kv_caches), 2, 2 * len(ids), *k.shape[1:]), generator=gen
                     ).to(k.dtype)[:, :, ::2]
    others = [i for i in range(n_blocks) if i not in ids][:3]
    before = runner.read_blocks(others).clone()
    runner.write_blocks(ids, kv)
    assert torch.equal(runner.read_blocks(ids), kv)
    assert torch.equal(runner.read_blocks(ids[::-1]), kv.flip(2))
    assert torch.equal(runner.read_blocks(others), before)  # nothing else written


def test_blocks_round_trip_through_the_packed_staging(tiny_qwen2_vl):
    with LLM(tiny_qwen2_vl, kv_cache_memory="2MiB", block_size=4) as llm:
        runner = llm.engine.core.runner
        runner.kv_staging = StepStaging(runner.device, pack=True)  # the GPU's packing
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):  # the buffer is reused
            _round_trip(runner, gen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned KV staging needs CUDA")
def test_kv_import_never_synchronises_on_cuda(tiny_qwen2_vl):
    import os

    os.environ.pop("TRITON_INTERPRET", None)
    with LLM(tiny_qwen2_vl, device="cuda", dtype="bfloat16", kv_cache_memory="64MiB") as llm:
        runner = llm.engine.core.runner
        gen = torch.Generator().manual_seed(1)
        k = runner.kv_caches[0][0]
        kv = torch.randn((len(runner.kv_caches), 2, 4, *k.shape[1:]), generator=gen).to(k.dtype)
        runner.write_blocks([0, 1, 2, 3], kv)  # (first use: the buffer is allocated)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.write_blocks([7, 5, 3, 1], kv)  # a synchronising copy raises here
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(runner.read_blocks([7, 5, 3, 1]), kv)
        _round_trip(runner, gen)
