"""The glyph teacher of the demo model's training (demo/train.py; training only, not
shipped), and the teacher-forced character accuracy the training log prints."""
from __future__ import annotations

from typing import Any

from triptych.demo import render


class TokenTargets:
    """The glyph teacher (training only, not shipped): a linear head on the vision tower's
    merged tokens predicts the characters each token shows, left to right, in ``SLOTS``
    slots (``NONE`` past the last). A dense per-token signal: the tower learns glyphs from
    every token of every image instead of only through the language model's loss, which
    early in training leans on the word prior and the line's length. The head reads the
    tower's output through a forward hook, so the forward runs once."""

    SLOTS = 4

    def __init__(self, model: Any) -> None:
        import torch

        self.none = len(render.CHARSET)
        self.head = torch.nn.Linear(model.config.text_config.hidden_size,
                                    self.SLOTS * (self.none + 1))
        self.captured: Any = None
        model.model.visual.register_forward_hook(self._keep)

    def _keep(self, module: Any, inputs: Any, output: Any) -> None:
        self.captured = output.pooler_output

    @classmethod
    def targets(cls, samples: list[tuple[Any, str, list[list[list[int]]]]]) -> Any:
        """One row of slots per merged token, in the tower's order (rows, then columns);
        -100 where a token shows more than ``SLOTS`` characters. Needs no head: a data
        process (demo/data_procs.py) calls it on the class."""
        import torch

        none, rows = len(render.CHARSET), []
        for _, _, grid in samples:
            for row in grid:
                for chars in row:
                    rows.append(chars + [none] * (cls.SLOTS - len(chars))
                                if len(chars) <= cls.SLOTS else [-100] * cls.SLOTS)
        return torch.tensor(rows)

    def loss(self, targets: Any) -> tuple[Any, float]:
        """(cross-entropy over the slots, accuracy on the slots that hold a character)."""
        import torch
        import torch.nn.functional as F

        logits = self.head(self.captured).view(-1, self.SLOTS, self.none + 1)
        if logits.shape[0] != targets.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} merged tokens but {targets.shape[0]} "
                               "targets: an image was resized by the processor")
        loss = F.cross_entropy(logits.reshape(-1, self.none + 1), targets.reshape(-1),
                               ignore_index=-100)
        with torch.no_grad():
            mask = (targets != -100) & (targets != self.none)
            hit = ((logits.argmax(-1) == targets) & mask).sum().item()
        return loss, hit / max(1, mask.sum().item())


def char_accuracy(logits: Any, labels: Any, eos: int) -> float:
    """Teacher-forced accuracy on the transcription's characters (the closing EOS left out:
    it is learned long before the glyphs and would hide them)."""
    import torch

    with torch.no_grad():
        lab, pred = labels[:, 1:], logits[:, :-1].argmax(-1)
        mask = (lab != -100) & (lab != eos)
        return ((pred == lab) & mask).sum().item() / max(1, mask.sum().item())
