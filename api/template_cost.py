"""What a chat template adds to a conversation, measured once per checkpoint, so that the
validation pass (api/request_checks.py) can bound a conversation's rendered size before
anything is rendered or tokenised.

Rendering costs CPU per message whatever the message holds: 250,000 empty user messages
rendered through Qwen's template are ~6 M characters and 500,000 special tokens (20 s of
P0's CPU before a context-length refusal). The template's own text per message is fixed,
so it is measured here by rendering a few probe conversations and taking differences:

    overhead(role) = len(render(C + [m_role])) - len(render(C)) - len(m_role's text)

clamped at 0 (a template may drop a role, or merge a message into the one before), the
smaller of two contexts; the first message of a conversation counts nothing (a system
message there can *replace* a default one). Special tokens (``<|im_start|>``, ``<|im_end|>``) are never merged with text by the
tokenizer, so the special tokens a role's overhead holds are a lower bound of the tokens
each such message adds. A role the probes cannot render (the template raises for it) gets
0. The bound only refuses what would be refused after rendering anyway (a prompt beyond
the context), so it never turns away a request the model could serve.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

PROBE_ROLES = ("user", "assistant", "system", "tool")
_ROLE_PAIR = re.compile(rb'"role"\s*:\s*"')  # a message's role (a string value)
OTHER = "*"  # any role the probes did not name (custom roles reach the template as sent)


@dataclass(frozen=True)
class RoleCost:
    chars: int = 0  # characters the template writes around one message of the role
    tokens: int = 0  # special tokens among them: a lower bound of the tokens it adds


@dataclass(frozen=True)
class TemplateCost:
    """Per role, the least a message adds to the rendered prompt (all zero: unknown)."""

    roles: dict[str, RoleCost] = field(default_factory=dict)

    def of(self, role: str) -> RoleCost:
        key = role if role in PROBE_ROLES else OTHER
        return self.roles.get(key, RoleCost())

    def bound(self, roles: Iterable[str]) -> RoleCost:
        """The least the template adds to a conversation with these messages' roles. The
        first message counts nothing: it may replace a default the template writes (Qwen's
        system prompt), so only the messages after it are sure to add their role's cost."""
        chars = tokens = 0
        for role in list(roles)[1:]:
            c = self.of(role)
            chars += c.chars
            tokens += c.tokens
        return RoleCost(chars, tokens)

    def least_per_message(self) -> int:
        """The fewest characters any one message adds (its role's text around it, plus the
        one the validation pass counts per message)."""
        return 1 + min([c.chars for c in self.roles.values()] or [0])

    def raw_bound(self, body: bytes, max_chars: int) -> str | None:
        """The validation pass's message bound on a chat body still unparsed (called by
        api/middleware.py before FastAPI validates it): parsing 250,000 messages into
        models holds P0's event loop ~0.7 s, and everyone's requests with it. Counts the
        ``"role": "..."`` pairs (a string value: a tool schema's "role" property is an
        object, and a pair inside a JSON string has its quotes escaped) and refuses, with
        the validation pass's own words, what it would refuse once parsed; None when it
        may go on. A whole body's scan is one ``bytes.count`` unless that is over."""
        least = self.least_per_message()
        if body.count(b'"role"') * least <= max_chars:
            return None
        n = len(_ROLE_PAIR.findall(body))
        if (n - 1) * least <= max_chars:  # (the first message counts nothing, as ``bound``)
            return None
        return (f"the messages and the chat template around them make at least "
                f"{(n - 1) * least} characters ({n} messages); this server takes at most "
                f"{max_chars} (--max-prompt-chars)")

    @classmethod
    def measure(cls, render: Callable[[list[dict]], str],
                count_special: Callable[[str], int]) -> TemplateCost:
        """Probe ``render`` (messages -> the rendered prompt text); ``count_special``
        counts the special tokens in a text. Each role is appended after another role and
        after itself (a template may merge consecutive messages of one role, as Qwen's do
        with tool results); the smaller cost counts."""
        def size(msgs: list[dict]) -> tuple[int, int] | None:
            try:
                text = render(msgs)
            except Exception:  # noqa: BLE001 - a template may refuse a probe (roles must alternate)
                return None
            return len(text), count_special(text)

        u, a = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
        roles: dict[str, RoleCost] = {}
        for role in (*PROBE_ROLES, OTHER):
            msg = {"role": "x-probe" if role == OTHER else role, "content": "m"}
            first = [u] if role == "assistant" else [u, a]
            costs = []
            for before in (first, [*first, msg]):
                s0, s1 = size(before), size([*before, msg])
                if s0 is not None and s1 is not None:
                    costs.append(RoleCost(max(0, s1[0] - s0[0] - len(msg["content"])),
                                          max(0, s1[1] - s0[1])))
            if costs:
                roles[role] = RoleCost(min(c.chars for c in costs),
                                       min(c.tokens for c in costs))
        return cls(roles)

    @classmethod
    def of_tokenizer(cls, tokenizer: Any) -> TemplateCost:
        """Measured with a Hugging Face tokenizer's chat template (zeros if it has none)."""
        if not getattr(tokenizer, "chat_template", None):
            return cls()
        specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t] + \
            [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
             if getattr(t, "special", False)]
        specials = sorted(set(specials), key=len, reverse=True)

        def count_special(text: str) -> int:
            n = 0
            for tok in specials:  # longest first, each occurrence taken out once counted
                n += text.count(tok)
                text = text.replace(tok, "\0")
            return n

        def render(msgs: list[dict]) -> str:
            return tokenizer.apply_chat_template(msgs, tokenize=False,
                                                 add_generation_prompt=False)

        return cls.measure(render, count_special)


__all__ = ["OTHER", "RoleCost", "TemplateCost"]
