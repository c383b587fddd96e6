"""Which model class serves which HF ``architectures`` entry: a view of the model
contracts (models/contract.py), kept for callers that only need the class."""
from __future__ import annotations

from triptych.models.contract import supported_architectures

__all__ = ["resolve_model_class", "supported_architectures"]


def resolve_model_class(architectures: list[str] | None) -> type:
    """The class for the first supported entry of a config's ``architectures``."""
    from triptych.models.contract import _CONTRACTS, _load

    for model_type in _CONTRACTS:
        c = _load(model_type)
        if any(a in c.architectures for a in architectures or []):
            return c.model_class()
    raise ValueError(f"unsupported model architecture {architectures!r}; "
                     f"supported: {', '.join(supported_architectures())}")
