"""triptych: a multimodal-first LLM serving engine.

Public API: ``LLM`` (offline batch jobs), ``SamplingParams`` (with
``StructuredOutputsParams``), ``BeamSearchParams``, ``EngineConfig``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from triptych.engine.device import cpu_features

# NOTE: before any torch op runs in this process: oneDNN, ATen and fbgemm read their
# instruction-set caps once, at their first use (TRIPTYCH_CPU_ISA, engine/device/cpu_features.py)
cpu_features.apply_switch()

from triptych.engine.sample.beam_search import BeamSearchParams
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.structured.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    from triptych.config import EngineConfig
    from triptych.llm import LLM

__version__ = "0.1.0"
__all__ = ["BeamSearchParams", "EngineConfig", "LLM", "SamplingParams", "StructuredOutputsParams",
           "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import triptych` stays cheap for the CLI and for worker processes.
    if name == "LLM":
        from triptych.llm import LLM
        return LLM
    if name == "EngineConfig":
        from triptych.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
