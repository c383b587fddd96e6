"""Checks every worker applies to what it receives (never trust a caller's placeholders)."""
from __future__ import annotations

from typing import Any

from triptych.engine.request import MMItem


def validate_request(prompt_token_ids: list[int], mm_items: list[MMItem], shape: Any,
                     max_model_len: int, vocab_size: int | None) -> None:
    """Raise ValueError naming the problem; accept only well-formed prompts and items."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if n >= max_model_len:
        raise ValueError(f"the prompt has {n} tokens but max_model_len is {max_model_len} "
                         "(prompt + at least one output token must fit); shorten the prompt, "
                         "use fewer/smaller images, or raise max_model_len")
    if vocab_size is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        bad = sorted({t for t in prompt_token_ids if not 0 <= t < vocab_size})
        raise ValueError(f"prompt token ids out of vocabulary: {bad[:10]} (the vocabulary "
                         f"is [0, {vocab_size}))")
    merge2 = shape.spatial_merge_size ** 2
    prev_end = 0
    for i, it in enumerate(sorted(mm_items, key=lambda x: x.offset)):
        what = f"{it.modality} #{i}"
        if it.modality not in ("image", "video"):
            raise ValueError(f"unsupported modality {it.modality!r}")
        t, h, w = it.grid_thw
        if min(t, h, w) < 1 or h % shape.spatial_merge_size or w % shape.spatial_merge_size:
            raise ValueError(f"{what}: bad patch grid {it.grid_thw}")
        if it.length != t * h * w // merge2:
            raise ValueError(f"{what}: {it.length} placeholder tokens for grid {it.grid_thw}")
        if it.offset < prev_end or it.end > n:
            raise ValueError(f"{what}: placeholder span [{it.offset}, {it.end}) overlaps "
                             "another item or leaves the prompt")
        prev_end = it.end
        token = shape.image_token_id if it.modality == "image" else shape.video_token_id
        if any(tok != token for tok in prompt_token_ids[it.offset:it.end]):
            raise ValueError(f"{what}: its placeholder span does not hold {it.modality} tokens")
        if it.pixel_values is not None and it.pixel_values.shape[0] != t * h * w:
            raise ValueError(f"{what}: {it.pixel_values.shape[0]} patches for grid {it.grid_thw}")
    spans = sum(it.length for it in mm_items)
    mm_tokens = sum(1 for tok in prompt_token_ids
                    if tok in (shape.image_token_id, shape.video_token_id))
    if mm_tokens != spans:
        raise ValueError(f"the prompt holds {mm_tokens} image/video placeholder tokens but its "
                         f"items cover {spans}")
