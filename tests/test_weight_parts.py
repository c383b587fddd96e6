"""Each process loads only the parts of the model it runs (models/weight_parts.py).

An encode worker builds the vision tower alone, a prefill/decode worker of a layout with an
encode pool the language model alone, and neither reads the other part's tensors from the
checkpoint. The pool-level check (E+P+D, measured by the workers) is in test_qwen3_vl.py.
"""
from __future__ import annotations

import pytest
import torch
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
    from triptych.kernels.cpu_linear import available

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
     "decode", "all"),  # a group loads everything
])
def test_which_parts_each_worker_loads(tiny_qwen2_vl, knobs, role, pool, want):
    assert weight_parts_for(EngineConfig(model=tiny_qwen2_vl, **knobs), role, pool) == want
