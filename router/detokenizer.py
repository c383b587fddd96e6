"""Incremental detokenization and stop strings, per request.

Decoding only the new ids breaks multi-byte characters and BPE merges, so each step
decodes a short window ``ids[prefix_offset:]`` and emits what extends past the already
emitted ``ids[prefix_offset:read_offset]``; a trailing U+FFFD means a character is still
incomplete and the text waits for the next token.
"""
from __future__ import annotations

import weakref
from typing import Any

# tokenizer -> {token id: its text}: logprobs name up to 21 tokens per output token (n=16
# sequences: 336 decodes a step, ~7 ms of P0 through HF's decode), and a tokenizer's decode
# of one id is the same every time
_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def tokenizer_memo(store: weakref.WeakKeyDictionary, tokenizer: Any) -> dict:
    """The dict ``store`` keeps for ``tokenizer`` (made empty the first time). Look it up
    once per request or step, not per token: a WeakKeyDictionary lookup makes a weak
    reference each time (per alternative, ~8% of P0's loop under n=16 x top_logprobs=20)."""
    try:
        memo = store.get(tokenizer)
        if memo is None:
            memo = store.setdefault(tokenizer, {})
    except TypeError:  # (a tokenizer that takes no weak reference: a memo of this call's)
        memo = {}
    return memo


def token_texts(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's {token id: its text} memo (filled by ``token_text``)."""
    return tokenizer_memo(_TOKEN_TEXTS, tokenizer)


def token_text(tokenizer: Any, tid: int, texts: dict[int, str] | None = None) -> str:
    """``tokenizer.decode([tid])``, decoded once per tokenizer and id (``texts``: the
    tokenizer's memo, ``token_texts``, when the caller holds it)."""
    if texts is None:
        texts = token_texts(tokenizer)
    text = texts.get(tid)
    if text is None:
        text = texts[tid] = tokenizer.decode([tid])
    return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str] | None,
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.ids: list[int] = []
        # A small window of prompt ids gives the first output token its left context.
        self._ctx = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self._ctx)
        self.text = ""
        self._emitted = 0  # chars of self.text already returned by pop_delta
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window(self, lo: int, hi: int | None = None) -> list[int]:
        """``(self._ctx + self.ids)[lo:hi]`` without building the whole list (a copy of
        every id per token would make a long output quadratic)."""
        n = len(self._ctx)
        hi = n + len(self.ids) if hi is None else hi
        if lo >= n:
            return self.ids[lo - n:hi - n]
        return self._ctx[lo:hi] + self.ids[:max(0, hi - n)]

    def add_token(self, token_id: int) -> str | None:
        """Append one id; return the stop string if the text now contains one."""
        self.ids.append(token_id)
        prefix = self._decode(self._window(self.prefix_offset, self.read_offset))
        full = self._decode(self._window(self.prefix_offset))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ctx) + len(self.ids)
            start = max(0, len(self.text) - self._max_stop)
            self.text += new
            return self._find_stop(start)
        return None

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append many ids with one decode (no stop strings: a completion nobody read while
        it grew). Gives the text ``add_token`` one by one would: a trailing character that
        is still incomplete (U+FFFD) is held back."""
        assert not self.stop, "stop strings need add_token"
        all_ids = self._ctx + self.ids + list(token_ids)
        self.ids += token_ids
        base = self._decode(all_ids[self.prefix_offset:self.read_offset])
        end = len(all_ids)
        full = self._decode(all_ids[self.prefix_offset:end])
        while end > self.read_offset and full.endswith("\ufffd"):
            end -= 1
            full = self._decode(all_ids[self.prefix_offset:end])
        if end > self.read_offset and len(full) > len(base):
            self.text += full[len(base):]
            self.prefix_offset, self.read_offset = self.read_offset, end

    def _find_stop(self, start: int) -> str | None:
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                return s
        return None

    def pop_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a tail that may begin a stop string."""
        hold = 0 if finished else max(self._max_stop - 1, 0)
        end = max(self._emitted, len(self.text) - hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
