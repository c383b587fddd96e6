"""GPU memory on a real CUDA device (skipped without one): pools sharing one GPU start with
the default memory knobs and give HF's greedy ids; engines in sequence in one process each
get the whole share; a share that is not free is refused in one line; kv_cache_memory is
honoured. The GPU check script runs this file (engine/sizing/memory.py, router/layout.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from triptych import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (GPU memory sizing)")

# fp32: the HF oracle's dtype; the memory knobs are the defaults (gpu_memory_utilization 0.9)
KNOBS = {"device": "cuda", "dtype": "float32", "max_model_len": 1024,
         "max_num_batched_tokens": 256}
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _img(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3),
                                                                dtype=np.uint8))


def _chat(text: str, *images: Image.Image) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


CONVS = [_chat("What is in this picture?", _img(1, 56, 84)),
         _chat("Compare these.", _img(2, 84, 56), _img(3, 112, 56)),
         [{"role": "user", "content": "Tell me a story about a cat."}]]


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    """HF's greedy ids for CONVS (fp32, on the CPU), from the one-process engine's prompts;
    the one-process engine on the GPU gives them too."""
    from triptych.models.hf_oracle import hf_greedy, load_hf_model

    with LLM(tiny_qwen2_vl, **KNOBS) as llm:
        prompts = [llm.processor.process_chat(c) for c in CONVS]
        pad = llm.get_tokenizer().pad_token_id or 0
        ours = [o.outputs[0].token_ids for o in llm.chat(CONVS, GREEDY, use_tqdm=False)]
    hf = load_hf_model(tiny_qwen2_vl)
    ids = [hf_greedy(hf, p, MAX_TOKENS, pad)[0] for p in prompts]
    assert ours == ids
    return ids


@pytest.mark.parametrize("layout", [
    {"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1},
    {"encode_workers": 1, "decode_workers": 1},
], ids=["1e1p1d", "E+PD"])
def test_pools_share_one_gpu_with_default_knobs(tiny_qwen2_vl, oracle, layout):
    with LLM(tiny_qwen2_vl, **KNOBS, **layout) as llm:
        outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == oracle
        workers = llm.pools.router.supervisor.workers
        need = [w.info["gpu_memory_share"] for w in workers if w.pool == "encode"]
        shares = [w.config["gpu_memory_utilization"] for w in workers if w.pool != "encode"]
        assert need[0] > 0 and all(s == shares[0] for s in shares)
        assert sum(need) + sum(shares) == pytest.approx(0.9, abs=1e-3)
        assert all(w.info["num_kv_blocks"] > 100 for w in workers if w.pool != "encode")


def test_engines_in_sequence_each_get_the_whole_share(tiny_qwen2_vl, oracle):
    blocks = []
    for _ in range(2):
        with LLM(tiny_qwen2_vl, **KNOBS) as llm:
            assert [o.outputs[0].token_ids
                    for o in llm.chat(CONVS, GREEDY, use_tqdm=False)] == oracle
            blocks.append(llm.engine.core.num_blocks)
            kv = sum(t.numel() * t.element_size() for pair in llm.engine.runner.kv_caches
                     for t in pair)
            assert kv <= 0.9 * torch.cuda.mem_get_info()[1]
    assert blocks[1] == pytest.approx(blocks[0], rel=0.02)
    assert torch.cuda.memory_allocated() < 64 << 20  # close() gave the memory back


def test_a_share_that_is_not_free_is_refused(tiny_qwen2_vl):
    free, total = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - total // 2), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(ValueError, match="--gpu-memory-utilization") as e:
            LLM(tiny_qwen2_vl, **KNOBS, gpu_memory_utilization=0.6)
        assert "\n" not in str(e.value)
    finally:
        del hog
        torch.cuda.empty_cache()


def test_kv_cache_memory_is_honoured_on_cuda(tiny_qwen2_vl):
    with LLM(tiny_qwen2_vl, **KNOBS, kv_cache_memory="64MiB") as llm:
        core = llm.engine.core
        assert core.num_blocks == (64 << 20) // core.block_bytes


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensor_parallel_ranks_agree_on_their_blocks(tiny_qwen2_vl, oracle):
    with LLM(tiny_qwen2_vl, **KNOBS, tensor_parallel_size=2) as llm:
        assert [o.outputs[0].token_ids
                for o in llm.chat(CONVS, GREEDY, use_tqdm=False)] == oracle
