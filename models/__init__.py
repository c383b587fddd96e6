"""Model definitions for the paged engine, checkpoint loading and M-RoPE positions."""
from __future__ import annotations

from triptych.models.loader import load_model
from triptych.models.mrope import compute_mrope_positions
from triptych.models.qwen2_vl import Qwen2VLForCausalLM
from triptych.models.registry import resolve_model_class, supported_architectures

__all__ = ["Qwen2VLForCausalLM", "compute_mrope_positions", "load_model",
           "resolve_model_class", "supported_architectures"]
