"""StructuredOutputsParams: what a request's output must match (vLLM's names and shape).

Exactly one constraint per request. It travels inside ``SamplingParams`` as a msgspec
Struct (never a compiled grammar: those are built where they are used, from ``key``,
through a per-tokenizer compile cache, ``engine/structured/grammar_compiler.py``).
"""
from __future__ import annotations

import json as _json
from typing import Any

import msgspec

MAX_SPEC_CHARS = 64 * 1024  # a schema / regex / grammar longer than this is refused

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One output constraint: set exactly one of the first six fields."""

    json: str | dict[str, Any] | None = None  # JSON schema (object or its JSON text)
    regex: str | None = None  # the whole output fully matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF / xgrammar dialect) or Lark grammar
    json_object: bool | None = None  # any JSON object (response_format json_object)
    structural_tag: str | None = None  # xgrammar structural tag, as JSON text
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens
    disable_additional_properties: bool = False  # JSON: objects take only listed keys
    whitespace_pattern: str | None = None  # (vLLM's outlines knob: refused if set)

    def __post_init__(self) -> None:
        self.verify()

    @property
    def kind(self) -> str:
        for k in KINDS:
            if getattr(self, k) not in (None, False):
                return k
        raise ValueError("structured_outputs sets no constraint")

    def verify(self) -> None:
        """Shape checks only (no compiling); raises ValueError naming the problem."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported "
                             "(use disable_any_whitespace)")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "strings")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if len(self.key[1]) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{given[0]} is longer than "
                             f"{MAX_SPEC_CHARS} characters")

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """(kind, canonical text, any whitespace, additional properties): the compile
        cache's key and everything a compiler needs."""
        kind = self.kind
        v = getattr(self, kind)
        if kind == "json":
            text = v if isinstance(v, str) else _json.dumps(v, sort_keys=True)
        elif kind == "choice":
            text = _json.dumps(v)
        elif kind == "json_object":
            text = ""
        else:
            text = v
        return (kind, text, not self.disable_any_whitespace,
                not self.disable_additional_properties)
