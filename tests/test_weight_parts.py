"""Each process loads only the parts of the model it runs (models/weight_parts.py).

An encode worker builds the vision tower alone, a prefill/decode worker of a layout with an
encode pool the language model alone, and neither reads the other part's tensors from the
checkpoint. The pool-level check of one-process workers (E+P+D, measured by the workers) is
in test_qwen3_vl.py; here, E+P+D with tensor-parallel groups of 2: every rank process
measures its own parameters.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from triptych import LLM, SamplingParams
from triptych.config import EngineConfig
from triptych.models import load_model
from triptych.models import loader as loader_mod
from triptych.models.weight_parts import weight_bytes
from triptych.parallel.loader import weight_parts_for


@pytest.fixture
def reads(monkeypatch):
    """Names of the checkpoint tensors actually read while loading."""
    seen: list[str] = []
    init, read = loader_mod.LazyTensor.__init__, loader_mod.LazyTensor.read

    def init_named(self, file, name):
        init(self, file, name)
        self.name = name

    def read_named(self, *a, **kw):
        seen.append(self.name)
        return read(self, *a, **kw)

    monkeypatch.setattr(loader_mod.LazyTensor, "__init__", init_named)
    monkeypatch.setattr(loader_mod.LazyTensor, "read", read_named)
    return seen


@pytest.mark.parametrize("parts", ["vision", "language"])
def test_a_part_builds_and_reads_only_its_tensors(tiny_qwen2_vl, reads, parts):
    model, _ = load_model(tiny_qwen2_vl, torch.float32, "cpu", parts=parts)
    names = [n for n, _ in model.named_parameters()]
    held = weight_bytes(model)
    if parts == "vision":
        assert names and all(n.startswith("visual.") for n in names)
        assert held["language"] == 0 < held["vision"]
        assert reads and all(".visual." in r or r.startswith("visual.") for r in reads)
    else:
        assert names and not any(n.startswith("visual.") for n in names)
        assert held["vision"] == 0 < held["language"]
        assert reads and not any("visual." in r for r in reads)
        with pytest.raises(ValueError, match="no vision tower"):
            model.encode_images(torch.zeros(4, 1176), torch.tensor([[1, 2, 2]]))


def test_the_parts_equal_the_whole(tiny_qwen2_vl):
    whole, _ = load_model(tiny_qwen2_vl, torch.float32, "cpu")
    vision, _ = load_model(tiny_qwen2_vl, torch.float32, "cpu", parts="vision")
    language, _ = load_model(tiny_qwen2_vl, torch.float32, "cpu", parts="language")
    w = dict(whole.named_parameters())
    for part in (vision, language):
        for n, p in part.named_parameters():
            assert torch.equal(p, w[n]), n
    assert sum(weight_bytes(whole).values()) == \
        weight_bytes(vision)["vision"] + weight_bytes(language)["language"]


def test_packed_linear_weights_are_counted(tiny_qwen2_vl):
    """Workers pack fp32 linear layers on the CPU (the dense parameter is left empty): the
    measured bytes must count the packed copies, or every worker would look weightless."""
    from triptych.kernels.cpu.linear import available

    if not available():
        pytest.skip("no oneDNN packed linear in this torch build")
    dense, _ = load_model(tiny_qwen2_vl, torch.float32, "cpu")
    packed, _ = load_model(tiny_qwen2_vl, torch.float32, "cpu", cpu_weights="float32")
    assert any(hasattr(m, "cpu_gemm") for m in packed.modules())
    assert weight_bytes(packed) == weight_bytes(dense)


@pytest.mark.parametrize("knobs,role,pool,want", [
    ({}, "engine", "", "all"),  # LLM / colocated
    ({"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1}, "encode", "encode",
     "vision"),
    ({"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1}, "engine", "prefill",
     "language"),
    ({"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1}, "engine", "decode",
     "language"),
    ({"encode_workers": 1, "decode_workers": 1}, "engine", "decode", "language"),  # E+PD
    ({"prefill_workers": 1, "decode_workers": 1}, "engine", "prefill", "all"),  # P+D
    ({"encode_workers": 1, "decode_workers": 1, "tensor_parallel_size": 2}, "engine",
     "decode", "language"),  # a group: the same parts, on every rank
    ({"encode_workers": 1, "decode_workers": 1, "tensor_parallel_size": 2}, "encode",
     "encode", "vision"),
    ({"prefill_workers": 1, "decode_workers": 1, "tensor_parallel_size": 2}, "engine",
     "decode", "all"),
])
def test_which_parts_each_worker_loads(tiny_qwen2_vl, knobs, role, pool, want):
    assert weight_parts_for(EngineConfig(model=tiny_qwen2_vl, **knobs), role, pool) == want


def test_a_group_checks_only_the_sizes_of_its_parts(tiny_qwen2_vl):
    """3 ranks divide neither the tiny LM's heads nor its tower's; a group (and a pool of
    a layout) is refused for the sizes of the parts it loads only."""
    from transformers import AutoConfig
    from triptych.models.tp_plan import check_layout_tp, check_tp_sizes

    hf = AutoConfig.from_pretrained(tiny_qwen2_vl, local_files_only=True)
    with pytest.raises(ValueError) as e:
        check_tp_sizes(hf, 3, "weights", "vision")
    assert "vision" in str(e.value) and "num_attention_heads=" not in str(e.value)
    with pytest.raises(ValueError) as e:
        check_tp_sizes(hf, 3, "weights", "language")
    assert "num_attention_heads=" in str(e.value) and "vision" not in str(e.value)
    # a whole tower on each of 3 encode ranks ("data") splits nothing: allowed in E+PD
    knobs = {"model": tiny_qwen2_vl, "encode_workers": 1, "decode_workers": 1,
             "mm_encoder_tp_mode": "data"}
    check_layout_tp(EngineConfig(**knobs, encode_tensor_parallel_size=3))
    with pytest.raises(ValueError, match="num_attention_heads="):
        check_layout_tp(EngineConfig(**knobs, decode_tensor_parallel_size=3))


@pytest.mark.parametrize("arch,mode", [("qwen3_vl", "weights"), ("internvl", "data")])
def test_tensor_parallel_pools_load_only_their_parts(arch, mode, tmp_path_factory):
    """E+P+D, 2 ranks per worker: greedy tokens equal HF's, and each rank process (rank 0
    and rank 1 of each group) holds only its pool's part, as it measured its own
    parameters. Qwen3-VL shards the tower, DeepStack mergers included ("weights": each
    encode rank holds less than the whole tower); InternVL keeps the tower and its
    projector whole on every encode rank ("data")."""
    from triptych.api.processor import InputProcessor
    from triptych.models.hf_oracle import hf_greedy, load_hf_model
    from triptych.models.tiny import make_tiny

    sys.path.insert(0, os.path.dirname(__file__))
    from server_fixtures import image_chat as chat
    from server_fixtures import img as image

    model = make_tiny(arch, str(tmp_path_factory.mktemp("tiny") / arch), seed=0)
    tower = weight_bytes(load_model(model, torch.float32, "cpu", parts="vision")[0])["vision"]
    conv = chat("Describe.", image(4, 56, 56))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model, block_size=4, kv_cache_memory="16MiB", max_model_len=256,
              encode_workers=1, prefill_workers=1, decode_workers=1, tensor_parallel_size=2,
              mm_encoder_tp_mode=mode)
    try:
        (out,) = llm.chat([conv], sp, use_tqdm=False)
        pad = llm.get_tokenizer().pad_token_id or 0
        pools = llm.pools.router.health()["pools"]
    finally:
        llm.close()
    prompt = InputProcessor(model).process_chat(conv)  # no P0 cache: the pixels are kept
    assert out.prompt_token_ids == prompt.prompt_token_ids
    assert out.outputs[0].token_ids == hf_greedy(load_hf_model(model), prompt, 4, pad)[0]
    for pool, held, absent in [("encode", "vision", "language"),
                               ("prefill", "language", "vision"),
                               ("decode", "language", "vision")]:
        (worker,) = pools[pool]["workers"]
        ranks = worker["weights"]["ranks"]
        assert len(ranks) == 2 and worker["weights"]["bytes"] == ranks[0], (pool, worker)
        for r in ranks:
            assert r[absent] == 0 < r[held], (pool, ranks)
        if pool == "encode":
            sharded = mode == "weights"
            assert all((r["vision"] < tower) == sharded for r in ranks), (ranks, tower)
