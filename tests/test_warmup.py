"""The start-up warm-up (engine/runner/warmup.py): the step shapes the first requests meet run
once before any request, so no user's step compiles a Triton variant.

Under the interpreter nothing compiles, but each launch names its variant (the kernel and
its constexpr arguments, what a GPU compiles once per value): the variants the first
requests launch (a short chat, a prompt chunked beside decodes, a prefix hit, a batch of
decodes with short and long contexts, sampled and greedy rows) must all have been
launched by the warm-up. The warm-up leaves no trace: no request, no block held, the same
ids as an engine that never warmed up.
"""
from __future__ import annotations

import os

import pytest
from triptych import LLM, SamplingParams

pytest.importorskip("triton")


@pytest.fixture
def launches(monkeypatch):
    """Every Triton launch's variant: (kernel, its constexpr arguments)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[tuple] = set()
    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        consts = tuple(sorted((k, v) for k, v in kwargs.items()
                              if k not in ("num_warps", "num_stages")))
        seen.add((self.fn.__name__, consts))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return seen


def _first_requests(llm: LLM) -> list[list[int]]:
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "the", "dog"]
    long = " ".join(words[i % len(words)] for i in range(60))
    prompts = [{"prompt": "Hello there"}, {"prompt": long}, {"prompt": long + " twice"},
               {"prompt": "A story:"}]
    sp = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], sp[:2], use_tqdm=False)]
    # a prefix hit (the long prompt again, longer) beside new work
    return first + [o.outputs[0].token_ids
                    for o in llm.generate(prompts[2:], sp[2:], use_tqdm=False)]


def test_the_warm_up_launches_every_variant_the_first_requests_use(tiny_qwen2_vl, launches):
    from triptych.engine.runner.warmup import warm_up
    from triptych.parallel.loader import text_token

    assert os.environ.get("TRITON_INTERPRET") == "1"
    knobs = {"attention_backend": "triton", "block_size": 4, "kv_cache_memory": "16MiB",
             "max_num_batched_tokens": 48, "cpu_threads": 1}
    cold = LLM(tiny_qwen2_vl, **knobs)
    want = _first_requests(cold)
    cold.close()
    launches.clear()
    llm = LLM(tiny_qwen2_vl, **knobs)
    core = llm.engine.core
    warm_up(core.runner, core.num_blocks, llm.config.block_size, core.max_model_len,
            text_token(core.shape))
    warmed = set(launches)
    assert not core.scheduler.requests and core.kv.pool.num_free_blocks == core.num_blocks
    launches.clear()
    assert _first_requests(llm) == want  # (nothing of the warm-up stayed behind)
    missing = launches - warmed
    assert not missing, f"variants first met by a request: {sorted(missing)}"
    assert any(name == "_decode_split_kernel" and ("ONE_SPLIT", False) in c
               for name, c in warmed) and \
        any(name == "_decode_split_kernel" and ("ONE_SPLIT", True) in c for name, c in warmed)
