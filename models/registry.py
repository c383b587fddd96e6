"""Which model class serves which HF ``architectures`` entry (imported lazily)."""
from __future__ import annotations

import importlib

# HF architecture name -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen2VLForConditionalGeneration": ("triptych.models.qwen2_vl", "Qwen2VLForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("triptych.models.qwen2_vl", "Qwen2VLForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type:
    """The class for the first supported entry of a config's ``architectures``."""
    for arch in architectures or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"unsupported model architecture {architectures!r}; "
                     f"supported: {', '.join(supported_architectures())}")
