"""What a chat template sees of a message's media parts.

Real checkpoints' templates differ in which part types they render: InternVL-HF's know only
``{"type": "image"}`` and would drop an OpenAI ``image_url`` part without a word. The
processor takes the media from the parts itself, then hands the template each media part
as the bare ``{"type": "image"}`` / ``{"type": "video"}`` every template knows.
"""
from __future__ import annotations


def template_messages(messages: list[dict]) -> list[dict]:
    """Media parts as ``{"type": "image"}`` / ``{"type": "video"}`` for the chat template:
    real checkpoints' templates (InternVL-HF's) know only those, and would drop an
    ``image_url`` part silently; the media themselves were taken from the parts already."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind in ("image_url", "image", "video_url", "video"):
                    part = {"type": kind.removesuffix("_url")}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out
