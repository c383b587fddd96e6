"""What the api hands the router: one prompt, prepared.

The router runs it through the pools without looking into how it was made; the items'
sources are opaque to it and go back to the input processor (``load_pixels``) when pixels
the processor cache skipped must be produced again."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triptych.engine.request import MMItem


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]  # placeholders already expanded
    mm_items: list[MMItem] = field(default_factory=list)  # in placeholder order
    prompt_text: str | None = None  # the text before expansion (None for token-id prompts)
    # NOTE: one per item, same order; an item with pixel_values=None (a processor-cache
    # hit) gets its pixels from here. Drop them once the request is dispatched. Each is an
    # api.processor.MediaSource; the router only hands it back to the processor.
    mm_sources: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """The request is over: its sources give back what they hold outside P0's memory
        (pixels a preparation process left in shared memory). Its owner calls this (the
        api's Generation, once every stream of the HTTP request has ended), never the
        router: a prompt may be run several times (beam search steps share its sources)."""
        for src in self.mm_sources:
            release = getattr(src, "release", None)
            if release is not None:
                release()
