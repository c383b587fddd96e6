"""`bench gpu --cpu-smoke`: a CUDA engine's start and steps, rehearsed on the CPU.

A smoke run proves the GPU script before a GPU sees it. Its engines take the CUDA engine's
path (engine/device/rehearsal.py: Triton under the interpreter, logits and the device sampler,
packed staging, async scheduling) and start as a CUDA engine does (parallel/loader.py):

    profile run     one step at the limits (largest image, prompt-logprobs chunk, sampler)
    trial capture   every decode graph size, rehearsed, then released
    KV sizing       the blocks a share of a device holds after what the profile measured
                    (here the "device" is numbers: weights + encoder cache + KV budget)
    warm-up         the step shapes of the first requests (engine/runner/warmup.py)
    capture         the decode graphs over the real cache (rehearsed: replays run eagerly)

What only a GPU runs: the capture itself, pinned memory, events, the copies.
"""
from __future__ import annotations

from typing import Any

from triptych.config import parse_size
from triptych.engine.device.cuda_graphs import GraphPlan
from triptych.engine.device.rehearsal import REHEARSAL_KNOBS, rehearse_cuda
from triptych.engine.sizing.memory import MemorySnapshot, Usage

KV_BUDGET = "4MiB"  # what the rehearsed share leaves for the KV cache


class HostMeter:
    """ProfileMeter's interface over numbers: a "device" of ``total`` bytes, all free; the
    profile measures nothing (the CPU has no allocator statistics to read)."""

    def __init__(self, total: int, weights: int) -> None:
        self.start = MemorySnapshot(free=total, total=total)
        self.weights = weights

    def begin(self) -> None:
        pass

    def usage(self, encoder_cache: int = 0) -> Usage:
        return Usage(weights=self.weights, peak_activation=0, non_torch=0,
                     encoder_cache=encoder_cache)


def rehearsed_llm(model: str, graph_sizes: list[int] | None = None, **knobs: Any
                  ) -> tuple[Any, dict[str, Any]]:
    """An ``LLM`` started as a CUDA engine starts, on the CUDA engine's path (module
    docstring), and what its start did."""
    from triptych.engine.engine_core import EngineCore
    from triptych.engine.runner.warmup import warm_up
    from triptych.llm import LLM
    from triptych.parallel.loader import size_by_profile, text_token

    knobs = {"kv_cache_memory": "2MiB", "async_scheduling": True, **REHEARSAL_KNOBS, **knobs}
    llm = LLM(model, **knobs)
    old = llm.engine.core
    config, loaded, runner = old.config, old.loaded, old.runner
    rehearse_cuda(old)  # (the profile step runs the CUDA path's sampler and staging)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    need = weights + parse_size(config.encoder_cache_size) + parse_size(KV_BUDGET)
    meter = HostMeter(int(need / config.gpu_memory_utilization) + 1, weights)
    plan = GraphPlan(list(graph_sizes or []), "" if graph_sizes else "eager")
    loaded.num_blocks = size_by_profile(config, loaded, runner, None, meter, "", plan)
    warm_up(runner, loaded.num_blocks, config.block_size, loaded.max_model_len,
            text_token(loaded.shape))
    old.grammars.close()  # (the new core makes its own compiler; the model stays loaded)
    core = llm.engine.core = EngineCore(config, loaded, eos_token_id=old.eos_token_id)
    rehearse_cuda(core, graph_sizes)
    start = {"kv_blocks": loaded.num_blocks, "graph_sizes": list(graph_sizes or []),
             "async_scheduling": core.async_scheduling, "warm_up_steps": runner.times.steps}
    return llm, start
