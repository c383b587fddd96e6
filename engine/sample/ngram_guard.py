"""The no-repeat n-gram guard of one request, kept up to date token by token.

A token t is banned when (the last n-1 output tokens, t) already occurs as an n-gram lying
inside the request's window (the last ``window`` output tokens; 0: the whole output). The
cost of a step must not grow with what the request chose (its n, its window, its
whitelist): it is paid by everyone in the batch. So each request keeps an index, updated
once per sampled token, of its n-grams by their first n-1 tokens:

    key(s) = rolling hash of out[s : s + n - 1]       (O(1) per token: prefix hashes)
    index[key(s)][out[s + n - 1]] = s                  (the latest start of that n-gram)

A step looks up the key of the last n-1 tokens: the next tokens found there whose latest
start lies in the window are banned (each checked against the actual tokens once, so a
hash collision bans nothing wrongly). The whitelist is a set made once, when the request
joins. Per step: O(n + distinct next tokens seen after this prefix), not O(window x n).
"""
from __future__ import annotations

_MOD = (1 << 61) - 1  # a Mersenne prime: the hashes stay machine-sized integers
_BASE = 1_000_003


class NgramGuard:
    """One request's n-gram index (``banned()`` is the step's question)."""

    def __init__(self, n: int, window: int, whitelist: list[int] | None,
                 outputs: list[int]) -> None:
        self.n, self.window = n, window
        self.whitelist = frozenset(whitelist or ())
        self.tokens: list[int] = []
        self._prefix = [0]  # _prefix[i]: hash of tokens[:i]
        self._shift = pow(_BASE, n - 1, _MOD)  # BASE^(n-1): drops a prefix of n-1 tokens
        self._index: dict[int, dict[int, int]] = {}  # key -> {next token: latest start}
        for t in outputs:
            self.append(t)

    def _key(self, start: int) -> int:
        """Hash of tokens[start : start + n - 1]."""
        end = start + self.n - 1
        return (self._prefix[end] - self._prefix[start] * self._shift) % _MOD

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self._prefix.append((self._prefix[-1] * _BASE + token + 1) % _MOD)
        start = len(self.tokens) - self.n  # the n-gram this token completes
        if start >= 0:
            self._index.setdefault(self._key(start), {})[token] = start

    def banned(self, vocab: int) -> list[int]:
        """The tokens that would repeat an n-gram of the window now (whitelist excluded,
        ids inside ``vocab`` only)."""
        n, length = self.n, len(self.tokens)
        if length < n or (self.window and self.window < n):
            return []
        nexts = self._index.get(self._key(length - n + 1))
        if not nexts:
            return []
        lowest = length - self.window if self.window else 0
        prefix = self.tokens[length - n + 1:]
        return [t for t, s in nexts.items()
                if s >= lowest and t < vocab and t not in self.whitelist
                and self.tokens[s:s + n - 1] == prefix]


__all__ = ["NgramGuard"]
