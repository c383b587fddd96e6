"""Encode pool: the vision tower behind an items-in, embeddings-out boundary."""
from triptych.encode.encoder_cache import EncoderCache
from triptych.encode.encoder_runner import EncoderRunner

__all__ = ["EncoderCache", "EncoderRunner"]
