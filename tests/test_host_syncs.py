"""The GPU step's contract, held on the CPU: no device read inside the forward, one per step.

A decode step and an image prefill step run through the engine with the Triton backend
(under TRITON_INTERPRET=1), with every read that would synchronise a GPU counted
(tests/host_syncs.py): the model's forward (vision tower and language model) must read
nothing back, and a whole step at most one thing (the sampled ids), also with sampling
parameters, penalties, logit bias and logprobs in the batch. The inputs must reach the
device in one copy and the ids leave it in one (engine/device_io.py). The Triton engine's
greedy ids must equal HF's, with HF's own processor on the raw image.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_chat_greedy, load_hf_model, load_hf_processor

sys.path.insert(0, os.path.dirname(__file__))
from host_syncs import count_host_syncs, report  # noqa: E402
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets the interpreter first"
    return LLM(tiny_qwen2_vl, block_size=4, kv_cache_memory="16MiB", attention_backend="triton")


@contextmanager
def steps_counted(llm: LLM) -> Iterator[list[dict]]:
    """Per engine step: device reads in the whole step and inside the model's forward
    (the language model and the vision tower), and whether the step encoded an image."""
    core = llm.engine.core
    runner, model = core.runner, core.model
    steps: list[dict] = []
    with count_host_syncs() as syncs:
        execute, forward, visual = runner.execute, model.forward, model.visual.forward

        def counted(fn, key):
            def wrapper(*a, **k):
                n = len(syncs.events)
                try:
                    return fn(*a, **k)
                finally:
                    steps[-1][key] += syncs.events[n:]
                    steps[-1]["vision"] |= key == "vision_reads"
            return wrapper

        def step(*a, **k):
            steps.append({"step_reads": [], "forward_reads": [], "vision_reads": [],
                          "vision": False})
            n = len(syncs.events)
            try:
                return execute(*a, **k)
            finally:
                steps[-1]["step_reads"] = syncs.events[n:]

        runner.execute = step
        model.forward = counted(forward, "forward_reads")
        model.visual.forward = counted(visual, "vision_reads")
        try:
            yield steps
        finally:
            del runner.execute, model.forward, model.visual.forward


def test_no_device_read_in_the_forward_and_one_per_step(llm):
    copies_in, copies_out = llm.engine.core.runner.staging, llm.engine.core.runner.fetch
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fancy = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3,
                           max_tokens=4, ignore_eos=True, logprobs=2, logit_bias={5: 2.0},
                           repetition_penalty=1.2, presence_penalty=0.3)
    for seed, sp in ((7, plain), (8, fancy)):  # (a new image each: none cached)
        conv = chat("What is in this picture?", image(seed, 84, 56))
        with steps_counted(llm) as steps:
            (out,) = llm.chat(conv, sp, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        assert any(s["vision"] for s in steps), "no step ran the vision tower"
        for i, s in enumerate(steps):
            inside = s["forward_reads"] + s["vision_reads"]
            assert not inside, f"step {i} read the device inside the forward:\n{report(inside)}"
            assert len(s["step_reads"]) <= 1, \
                f"step {i} read the device {len(s['step_reads'])} times:\n{report(s['step_reads'])}"
        decodes = [s for s in steps if not s["vision"]]
        assert decodes and all(len(s["step_reads"]) == 1 for s in decodes)
    # on the CPU the staging copies nothing (the device is the host); the counters exist
    # for the GPU check, where each step makes exactly one copy each way
    assert copies_in.num_copies == 0 and copies_out.num_copies == 0


def test_triton_engine_equals_hf(llm, tiny_qwen2_vl):
    conv = chat("What is in this picture?", image(30, 112, 84))
    (out,) = llm.chat(conv, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                      use_tqdm=False)
    prompt, tokens, _ = hf_chat_greedy(load_hf_model(tiny_qwen2_vl),
                                       load_hf_processor(tiny_qwen2_vl), conv, 5)
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == tokens


def test_staging_and_fetch_pack_arrays_into_one_buffer():
    """The GPU's packing (one buffer each way, 16-byte aligned views), run on the CPU."""
    import numpy as np
    import torch
    from triptych.engine.device_io import HostFetch, StepStaging

    staging = StepStaging(torch.device("cpu"), pack=True)
    arrays = [np.arange(5, dtype=np.int64), np.ones((3, 2), np.float32),
              np.array([7, 8, 9], np.int32), np.zeros(0, np.int64), np.array([True, False])]
    for step in range(2):  # the buffer is reused (and grows) across steps
        arrays[0] = arrays[0] + step * 1000
        views = staging.stage(arrays)
        base = views[0].untyped_storage().data_ptr()
        for a, v in zip(arrays, views):
            assert v.dtype == torch.from_numpy(a).dtype and np.array_equal(v.numpy(), a)
            assert v.untyped_storage().data_ptr() == base  # one buffer
            assert (v.data_ptr() - base) % 16 == 0
    fetch = HostFetch(torch.device("cpu"))
    ids, top = torch.tensor([3, 1, 2], dtype=torch.int32), torch.randn(2, 4)
    got = fetch.fetch([ids, top, top.argsort(-1)])
    assert np.array_equal(got[0], ids.numpy()) and np.array_equal(got[1], top.numpy())
    assert np.array_equal(got[2], top.argsort(-1).numpy())


def test_a_gpu_engine_never_imports_the_cpu_kernels():
    """The device seam (engine/platform.py): every module a CUDA engine runs (the API, the
    router, the pools, the loader, every model) imports nothing from kernels/cpu/ (packed
    weights, the panel GEMM and its argmax, the GEMV, the fused ops and their C++ builds);
    only a CPU engine's choices reach them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import triptych.llm, triptych.api.server, triptych.parallel.loader\n"
        "import triptych.encode.worker, triptych.prefill.worker, triptych.decode.worker\n"
        "import triptych.models.qwen2_vl, triptych.models.qwen3_vl, triptych.models.internvl\n"
        "from triptych.engine.platform import sampler_argmax\n"
        "import torch\n"
        "assert sampler_argmax(torch.device('cuda')).__name__ == 'torch_argmax'\n"
        "print(sorted(m for m in sys.modules if m.startswith('triptych.kernels.cpu')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
