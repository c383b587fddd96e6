"""The GPU step's contract, held on the CPU: no device read inside the forward, one per step.

The engine runs the CUDA engine's path (engine/device/rehearsal.py: the Triton kernels under
TRITON_INTERPRET=1, ``F.linear`` in the model's dtype, logits and the device sampler, the
step's arrays packed into one staged buffer, decode steps through the CUDA graph runner,
async scheduling) over a batch whose requests join and leave: mixed steps (prompts chunked
beside decodes), an image chunked across steps, a prefix hit, graph replays, every sampling
option. Every op that would synchronise a GPU is counted (tests/host_syncs.py: reads,
data-dependent sizes, pageable copies; inside ``torch.inference_mode`` too): the model's
forward (language model and vision tower) must make none, and so must the rest of a step,
whose one wait is the read of its sampled ids (``HostFetch.wait``). A copy of a model's
forward with any one of five classic syncs added must fail the same check. The Triton
engine's greedy ids equal HF's, with HF's own processor on the raw image.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from triptych import LLM, SamplingParams
from triptych.engine.device.rehearsal import REHEARSAL_KNOBS, rehearse_cuda
from triptych.models.hf_oracle import hf_chat_greedy, load_hf_model, load_hf_processor

sys.path.insert(0, os.path.dirname(__file__))
from host_syncs import count_host_syncs, report  # noqa: E402
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402

pytest.importorskip("triton")

GRAPH_SIZES = [1, 2, 4]


def cuda_path_llm(model: str, **kw) -> LLM:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets the interpreter first"
    llm = LLM(model, block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=24,
              max_num_seqs=3, async_scheduling=True, cpu_threads=1,
              **{**REHEARSAL_KNOBS, **kw})
    rehearse_cuda(llm.engine.core, GRAPH_SIZES)
    return llm


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return cuda_path_llm(tiny_qwen2_vl)


@contextmanager
def guarded(llm: LLM) -> Iterator[dict[str, list]]:
    """Every sync-making op during the block, by where it ran: ``forward`` (the language
    model and the vision tower), ``step`` (the rest of prepare / sample / collect); and
    ``waits``: the reads of sampled ids (one per step that samples)."""
    core = llm.engine.core
    runner, model = core.runner, core.model
    seen: dict[str, list] = {"forward": [], "step": [], "waits": []}
    with count_host_syncs() as syncs:
        def counted(fn: Callable, key: str) -> Callable:
            def wrapper(*a, **k):
                n = len(syncs.events)
                try:
                    return fn(*a, **k)
                finally:
                    seen[key] += syncs.events[n:]
                    del syncs.events[n:]
            return wrapper

        wait = runner.fetch.wait

        def one_wait(f):
            seen["waits"].append(f)
            return wait(f)

        patches = [(runner, "prepare", counted(runner.prepare, "step")),
                   (runner, "sample", counted(runner.sample, "step")),
                   (runner, "collect", counted(runner.collect, "step")),
                   (runner.fetch, "wait", one_wait),
                   (model, "forward", counted(model.forward, "forward"))]
        tower = getattr(model, "visual", None) or getattr(model, "vision", None)
        if tower is not None:
            patches.append((tower, "forward", counted(tower.forward, "forward")))
        before = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        try:
            yield seen
        finally:
            for obj, name, old in before:  # (an instance attribute set before: kept)
                if old is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)


def workload(llm: LLM, seed: int = 0) -> list[list[int]]:
    """Requests that join and leave (3 seats, 7 requests), prompts chunked beside decodes
    (24 tokens a step), an image chunked across steps and sent twice (a prefix hit), decode
    steps of 1-3 rows (graph replays), greedy and sampled rows with every option."""
    fancy = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3,
                           max_tokens=5, ignore_eos=True, logprobs=2, logit_bias={5: 2.0},
                           repetition_penalty=1.2, presence_penalty=0.3)
    plain = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(4)]
    conv = chat("What is in this picture?", image(seed + 7, 112, 84))
    outs = [o.outputs[0].token_ids for o in llm.chat([conv, conv], [plain[0], fancy],
                                                     use_tqdm=False)]
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "the", "dog"]
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(2 + 9 * i)) for i in range(5)]
    return outs + [o.outputs[0].token_ids for o in llm.generate(
        prompts, plain + [fancy], use_tqdm=False)]


def check(seen: dict[str, list]) -> None:
    assert not seen["forward"], f"the forward read the device:\n{report(seen['forward'])}"
    assert not seen["step"], f"a step read the device:\n{report(seen['step'])}"


def test_no_device_read_in_the_forward_and_one_per_step(llm):
    core = llm.engine.core
    runner = core.runner
    steps0, replays0 = runner.times.steps, runner.graphs.num_replays
    with guarded(llm) as seen:
        workload(llm)
    check(seen)
    steps = runner.times.steps - steps0
    assert 0 < len(seen["waits"]) <= steps  # one read a step (a chunk short of its end: none)
    assert runner.graphs.num_replays > replays0, "no decode step replayed a graph"
    assert runner.num_inputs_from_device > 0, "no input came from the step in flight"
    assert core.encoder.num_items_encoded > 0 and core.kv.num_prefix_hits > 0
    # on the CPU the staging copies nothing (the device is the host); the counters exist
    # for the GPU check, where each step makes exactly one copy each way
    assert runner.staging.num_copies == 0 and runner.fetch.num_copies == 0


MUTANTS: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "int(t.max())": lambda ids, pos: int(pos.max()),
    "bool(mask.any())": lambda ids, pos: bool((ids > 3).any()),
    "a boolean-mask index": lambda ids, pos: ids[ids > 3],
    "torch.unique": lambda ids, pos: torch.unique(ids),
    "repeat_interleave without output_size": lambda ids, pos: torch.repeat_interleave(
        ids, torch.ones_like(ids)),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_sync_added_to_the_forward_is_caught(llm, mutant):
    """The check above fails for a model whose forward does any one of these (turn 4's own
    bug was the first: ``int(positions.max())``), inside inference_mode as the engine runs
    it, in prefill, mixed and graph-replayed decode steps alike."""
    model = llm.engine.core.model
    forward = model.forward
    hits = []

    def mutated(input_ids, positions, *a, **k):
        hits.append(MUTANTS[mutant](input_ids, positions))
        return forward(input_ids, positions, *a, **k)

    model.forward = mutated
    try:
        with guarded(llm) as seen:
            llm.generate(["the cat sat on the mat", "a dog"], SamplingParams(
                temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        del model.forward
    assert hits
    with pytest.raises(AssertionError, match="the forward read the device"):
        check(seen)
    assert len(seen["forward"]) >= len(hits)  # every call of it, not one in the run


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_other_models_read_nothing_either(tmp_path_factory, arch):
    """Qwen2.5-VL's windows, Qwen3-VL's DeepStack and interleaved M-RoPE, InternVL's tiles."""
    from triptych.models.tiny import make_tiny

    model = make_tiny(arch, str(tmp_path_factory.mktemp("tiny") / arch), seed=0)
    other = cuda_path_llm(model)
    with guarded(other) as seen:
        workload(other, seed=1)
    check(seen)
    assert other.engine.core.encoder.num_items_encoded > 0
    other.close()


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
    from triptych.engine.device.device_io import HostFetch, StepStaging

    staging = StepStaging(torch.device("cpu"), pack=True)
    arrays = [np.arange(5, dtype=np.int64), np.ones((3, 2), np.float32),
              np.array([7, 8, 9], np.int32), np.zeros(0, np.int64), np.array([True, False]),
              torch.arange(4, dtype=torch.bfloat16)]
    for step in range(3):  # the buffers are reused (and grow) across steps
        arrays[0] = arrays[0] + step * 1000
        views = staging.stage(arrays)
        base = views[0].untyped_storage().data_ptr()
        for a, v in zip(arrays, views):
            want = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
            assert v.dtype == want.dtype and torch.equal(v, want)
            assert v.untyped_storage().data_ptr() == base  # one buffer
            assert (v.data_ptr() - base) % 16 == 0
    fetch = HostFetch(torch.device("cpu"))
    ids, top = torch.tensor([3, 1, 2], dtype=torch.int32), torch.randn(2, 4)
    got = fetch.fetch([ids, top, top.argsort(-1)])
    assert np.array_equal(got[0], ids.numpy()) and np.array_equal(got[1], top.numpy())
    assert np.array_equal(got[2], top.argsort(-1).numpy())
    first = fetch.start([ids])  # two copies in flight (async scheduling), read in order
    second = fetch.start([ids + 1])
    assert fetch.wait(first)[0].tolist() == [3, 1, 2]
    assert fetch.wait(second)[0].tolist() == [4, 2, 3]


def test_a_gpu_engine_never_imports_the_cpu_kernels():
    """The device seam (engine/device/platform.py): every module a CUDA engine runs (the API, the
    router, the pools, the loader, every model) imports nothing from kernels/cpu/ (packed
    weights, the panel GEMM and its argmax, the GEMV, the fused ops and their C++ builds);
    only a CPU engine's choices reach them."""
    import subprocess

    code = (
        "import sys\n"
        "import triptych.llm, triptych.api.server, triptych.parallel.loader\n"
        "import triptych.encode.worker, triptych.prefill.worker, triptych.decode.worker\n"
        "import triptych.models.qwen2_vl, triptych.models.qwen3_vl, triptych.models.internvl\n"
        "from triptych.engine.device.platform import sampler_argmax\n"
        "import torch\n"
        "assert sampler_argmax(torch.device('cuda')).__name__ == 'torch_argmax'\n"
        "print(sorted(m for m in sys.modules if m.startswith('triptych.kernels.cpu')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
