"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit runs."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    """A tiny random Qwen2-VL checkpoint, made once per test session by make_tiny."""
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen2_vl", str(tmp_path_factory.mktemp("tiny") / "qwen2_vl"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen2_5_vl", str(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl"), seed=0)
