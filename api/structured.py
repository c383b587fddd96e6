"""Structured output in a request body: every spelling clients send, to one
``StructuredOutputsParams``, and its compile check before any work is done.

    response_format     {"type": "json_object"}                       -> json_object
                        {"type": "json_schema", "json_schema": {"schema": ..., "strict"}}
                                                                      -> json
                        {"type": "structural_tag", "structures", "triggers"}
                                                                      -> structural_tag
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object" |
                         "structural_tag", "disable_any_whitespace", ...}   (vLLM)
    guided_json / guided_regex / guided_choice / guided_grammar       (vLLM, older)

At most one of these per request; a refusal is a 400 naming the field and the reason (an
invalid schema, regex or grammar as the compiler words it, a schema nested deeper than
``--max-structured-depth``, a grammar that matches nothing, or a compile over
``--grammar-compile-timeout``). The compile runs in P0's compile processes
(api/grammar_check.py), each tenant within its share of them.
"""
from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from triptych.api.errors import APIError, bad_request
from triptych.api.grammar_check import CheckerDown, CompileBusy, GrammarChecker
from triptych.engine.structured.structured_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _set(v: Any) -> bool:
    return v is not None and v != [] and v != {} and v != ""


def _from_response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad_request("response_format", "response_format json_schema needs "
                                                 "json_schema.schema (a JSON schema object)")
        # NOTE: strict or not, the schema is enforced (the grammar allows nothing else);
        # strict (OpenAI's strict structured outputs) also means no property the schema
        # does not name, as vLLM's xgrammar default has it.
        if js.get("strict"):
            return {"json": js["schema"], "disable_additional_properties": True}
        return {"json": js["schema"]}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in rf.items() if k != "type"})}
    raise bad_request("response_format", f"response_format type {kind!r} is not one of "
                                         "text, json_object, json_schema, structural_tag")


def structured_outputs(body: Any, max_depth: int | None = None
                       ) -> StructuredOutputsParams | None:
    """The request's output constraint, or None. Raises APIError (400) on a bad one (one
    nested deeper than ``max_depth`` included)."""
    given: list[tuple[str, dict[str, Any]]] = []
    from triptych.api.tools.checks import tool_constraint

    tool = tool_constraint(body)  # tool_choice required / named (api/tools/)
    if tool is not None:
        given.append(("tools", tool))
    rf = getattr(body, "response_format", None)
    if _set(rf):
        d = _from_response_format(rf)
        if d is not None:
            given.append(("response_format", d))
    so = getattr(body, "structured_outputs", None)
    if _set(so):
        if not isinstance(so, dict):
            raise bad_request("structured_outputs", "structured_outputs must be an object")
        given.append(("structured_outputs", so))
    for name, kind in _GUIDED.items():
        v = getattr(body, name, None)
        if _set(v):
            given.append((name, {kind: v}))
    if not given:
        return None
    if len(given) > 1 and given[0][0] == "tools":
        given = given[:1]  # (check_tools refuses a second constraint beside a named choice)
    if len(given) > 1:
        raise bad_request(given[1][0], "give one output constraint; this request has "
                                       f"{', '.join(n for n, _ in given)}")
    param, fields = given[0]
    if max_depth is not None:
        for name in ("json", "structural_tag"):  # (before parsing: a parser recurses)
            v = fields.get(name)
            depth = json_depth(v if isinstance(v, str) else json.dumps(v)) if v else 0
            if depth > max_depth:
                raise bad_request(param, f"{param}: the {name} constraint nests {depth} "
                                         f"levels deep; the limit is {max_depth} "
                                         "(--max-structured-depth)")
    try:
        return msgspec.convert(fields, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError, RecursionError) as e:
        raise bad_request(param, f"{param}: {e}") from None


async def check_structured(spec: StructuredOutputsParams | None, body: Any,
                           checker: GrammarChecker, tenant: str | None) -> None:
    """Compile the request's parsed constraint (``structured_outputs``) in a compile
    process, time-bounded, in the tenant's share: a schema / regex / grammar that does not
    compile is refused here, before media is fetched or text tokenized."""
    if spec is None:
        return
    try:
        await checker.check(spec, tenant)
    except ValueError as e:
        raise bad_request(_param(body), str(e)) from None
    except CompileBusy:
        raise APIError(429, "too many structured-output compiles of yours are waiting; "
                            "retry shortly", "rate_limit_error", _param(body),
                       {"Retry-After": "1"}) from None
    except CheckerDown as e:
        raise APIError(503, str(e), "server_error") from None


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def json_depth(text: str) -> int:
    """How deep ``text`` (JSON) nests objects and arrays, counted without parsing it."""
    depth = deepest = 0
    for ch in re.findall(r"[\[\]{}]", _STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _param(body: Any) -> str:
    from triptych.api.tools.checks import tool_constraint

    if tool_constraint(body) is not None:
        return "tools"
    for name in ("response_format", "structured_outputs", *_GUIDED):
        if _set(getattr(body, name, None)):
            return name
    return "structured_outputs"


__all__ = ["check_structured", "json_depth", "structured_outputs"]
