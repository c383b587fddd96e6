"""``truncate_prompt_tokens`` / ``truncation_side`` (vLLM's extension): keep the last (left
truncation, the default) or the first (right) k tokens of an expanded prompt.

An image or video is all or nothing: its placeholder span is kept whole or dropped whole
(with its pixels); a cut through a span is refused, since half an image's embeddings in the
prompt is not something the model was trained on.
"""
from __future__ import annotations

import dataclasses

from triptych.api.errors import bad_request
from triptych.router.prompt import ProcessedPrompt


def keep_count(requested: int, max_model_len: int, max_tokens: int | None) -> int:
    """Tokens to keep: ``-1`` means as many as fit beside the requested output."""
    if requested == -1:
        return max(1, max_model_len - (max_tokens or 1))
    return requested


def truncate(prompt: ProcessedPrompt, keep: int, side: str) -> ProcessedPrompt:
    ids = prompt.prompt_token_ids
    n = len(ids)
    if keep >= n:
        return prompt
    start, end = (n - keep, n) if side == "left" else (0, keep)
    items, sources = [], []
    srcs = prompt.mm_sources or [None] * len(prompt.mm_items)
    for i, (it, src) in enumerate(zip(prompt.mm_items, srcs)):
        if it.end <= start or it.offset >= end:
            continue  # wholly cut off: dropped with its pixels
        if it.offset < start or it.end > end:
            raise bad_request("truncate_prompt_tokens", (
                f"keeping the {'last' if side == 'left' else 'first'} {keep} of {n} prompt "
                f"tokens would cut through {it.modality} #{i} (placeholder tokens "
                f"{it.offset} to {it.end - 1}); keep all of its tokens or none"))
        # NOTE: a new item, never the processor's: items may be shared by a cache.
        items.append(dataclasses.replace(it, offset=it.offset - start))
        sources.append(src)  # (a processor-cache hit makes its pixels from it)
    return ProcessedPrompt(ids[start:end], items, None, sources if prompt.mm_sources else [])


__all__ = ["keep_count", "truncate"]
