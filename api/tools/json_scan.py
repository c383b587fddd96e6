"""Where the pieces of a tool call are in model text that is still growing.

Streaming a tool call means telling, from the text so far, which function is called and how
much of its arguments has arrived, without waiting for the JSON to close. These scanners
read JSON as far as it goes and answer with spans of the text, never parsed values, so a
span seen now is a prefix of the span seen later (the text only grows): what was streamed
never has to be taken back.

    scan_object(text, i)  ->  ObjectScan: each top-level key's value span (end None while
                              the value is unfinished), where the object ends (or None)
    scan_array(text, i)   ->  the element objects of a JSON array, as ObjectScans
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"


@dataclass
class ObjectScan:
    """One JSON object seen as far as the text goes."""

    start: int
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> span
    end: int | None = None  # index after the closing brace; None: not closed yet
    bad: bool = False  # the text is not JSON here (the object can never close)

    def raw(self, text: str, key: str) -> str | None:
        """The value of ``key`` as written so far (None: the key has not begun)."""
        span = self.values.get(key)
        if span is None:
            return None
        return text[span[0]:span[1] if span[1] is not None else len(text)].rstrip(_WS)

    def complete(self, key: str) -> bool:
        span = self.values.get(key)
        return span is not None and span[1] is not None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i]`` is a quote: the index after its closing quote, or None if unfinished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]``, or None if it is not finished
    in ``text`` (a scalar at the very end of the text counts as unfinished: more digits may
    follow)."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, i: int) -> ObjectScan:
    """Scan the object whose ``{`` is at ``text[i]``."""
    scan = ObjectScan(i)
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return scan
        if text[i] != '"':
            scan.bad = True
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.bad = True
            return scan
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.bad = True
            return scan
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end = value_end(text, i)
        scan.values[key] = (i, end)
        if end is None:
            return scan
        i = end


def escape_controls(raw: str) -> str:
    """``raw`` (JSON, possibly unfinished) with every control character inside a string
    written as its ``\\u00XX`` escape. JSON forbids them raw, and a grammar may still let a
    weak model write one (xgrammar's strings take any character but the quote, backslash,
    CR and LF); escaping keeps the value and makes the text JSON. Character by character,
    so the escaped text of a prefix is a prefix of the escaped whole (what streamed stays)."""
    if not any(c < " " for c in raw):
        return raw
    out, in_string, escaped = [], False, False
    for c in raw:
        if in_string and c < " " and not escaped:
            out.append(f"\\u{ord(c):04x}")
            continue
        out.append(c)
        if escaped:
            escaped = False
        elif in_string and c == "\\":
            escaped = True
        elif c == '"':
            in_string = not in_string
    return "".join(out)


def scan_array(text: str, i: int) -> tuple[list[ObjectScan], int | None, bool]:
    """The objects of the array whose ``[`` is at ``text[i]``: (elements, the index after
    ``]`` or None, whether the text stopped being an array of objects)."""
    out: list[ObjectScan] = []
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return out, None, False
        c = text[i]
        if c == "]":
            return out, i + 1, False
        if c == "," and out:
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return out, None, False
            c = text[i]
        if c != "{":
            return out, None, True
        obj = scan_object(text, i)
        out.append(obj)
        if obj.bad:
            return out, None, True
        if obj.end is None:
            return out, None, False
        i = obj.end


__all__ = ["ObjectScan", "escape_controls", "scan_array", "scan_object", "skip_ws",
           "value_end"]
