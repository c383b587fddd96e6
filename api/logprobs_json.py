"""A whole chat answer's logprobs written straight as JSON text (api/openai_format.py
``Formatter.add``), without building a dict per token and alternative first.

Of one alternative's JSON, ``{"token":"...","logprob":-1.25,"bytes":[...]}``, only the
logprob changes from one token to the next: the rest is the token id's, rendered once per
tokenizer and kept (``ItemPieces``). The text is the same, byte for byte, as
``json.dumps(..., ensure_ascii=False, allow_nan=False, separators=(",", ":"))`` of the dicts
(tests/test_big_answers.py compares them): a finite float is written by ``float.__repr__``
in both, and a non-finite one is refused by json's own error. Under n=16 x top_logprobs=20
the dicts and their encoding were ~20% of P0's event loop.
"""
from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable
from typing import Any

from triptych.router.detokenizer import tokenizer_memo

# tokenizer -> (tokens as ids?) -> {id: (head, tail)}: the JSON around an alternative's logprob
_PIECES: weakref.WeakKeyDictionary[Any, dict[bool, dict[int, tuple[str, str]]]] = \
    weakref.WeakKeyDictionary()
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _number(v: float) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return float.__repr__(v)
    return _dumps(v)  # an int as json writes it; inf / nan: json's ValueError


class ItemPieces:
    """Per token id, the JSON of an alternative around its logprob, for one tokenizer and
    one way of naming tokens (``name``: id -> the "token" text)."""

    def __init__(self, tokenizer: Any, tokens_as_ids: bool, name: Callable[[int], str]) -> None:
        self.name = name
        self.pieces = tokenizer_memo(_PIECES, tokenizer).setdefault(tokens_as_ids, {})

    def _of(self, tid: int) -> tuple[str, str]:
        p = self.pieces.get(tid)
        if p is None:
            tok = self.name(tid)
            p = self.pieces[tid] = ('{"token":' + _dumps(tok) + ',"logprob":',
                                    ',"bytes":' + _dumps(list(tok.encode())))
        return p

    def content(self, ids: list[int], lps: list[dict[int, float]], k: int) -> str:
        """The items of a chat answer's ``logprobs.content`` for ``ids``, comma-joined: each
        token with its logprob, bytes and its ``k`` likeliest alternatives."""
        out = []
        for tid, d in zip(ids, lps):
            head, tail = self._of(tid)
            top = []
            for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]:
                h, b = self._of(t)
                top.append(h + _number(v) + b + "}")
            out.append(head + _number(d[tid]) + tail + ',"top_logprobs":[' + ",".join(top)
                       + "]}")
        return ",".join(out)


__all__ = ["ItemPieces"]
