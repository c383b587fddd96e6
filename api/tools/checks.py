"""The chat request's tool fields against the server's limits: one call from
api/request_checks.py (``check_chat``), before any work is done.

Beyond ``plan_tools``: the definitions count towards the prompt's character budget (the
template writes them into the prompt) and their schemas towards ``--max-structured-depth``;
a named choice with another output constraint is refused (vLLM: "structured outputs or
tools, not both"); a parser whose tags are special tokens keeps special tokens in the text
(vLLM's ``adjust_request``).
"""
from __future__ import annotations

from typing import Any

from triptych.api.errors import bad_request
from triptych.api.tools.parsers import parser_for
from triptych.api.tools.plan import ToolPlan, ToolSettings, constraint, plan_tools, tools_chars

_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar")


def chat_plan(body: Any, settings: ToolSettings | None = None) -> ToolPlan | None:
    """The plan of a checked chat body (``settings`` None: the auto flags are not checked,
    for the constraint, which does not depend on them)."""
    return plan_tools(body.tools, body.tool_choice, getattr(body, "parallel_tool_calls", None),
                      settings or ToolSettings("any", True))


def check_tools(body: Any, settings: ToolSettings, max_chars: int, max_depth: int) -> int:
    """Check the chat body's tools; returns the characters they add to the prompt."""
    plan = chat_plan(body, settings)
    if plan is None:
        return 0
    chars = tools_chars(body.tools)
    if chars > max_chars:
        raise bad_request("tools", f"the tool definitions hold {chars} characters; this "
                                   f"server takes at most {max_chars} (--max-prompt-chars)")
    for i, f in enumerate(plan.functions):
        if f.parameters and nesting(f.parameters) > max_depth:
            raise bad_request(f"tools.{i}.function.parameters",
                              f"tools.{i}: the parameters schema nests deeper than "
                              f"{max_depth} levels (--max-structured-depth)")
    if plan.constrained:
        given = [n for n in _CONSTRAINTS if getattr(body, n, None) not in (None, {}, [], "")]
        rf = getattr(body, "response_format", None)
        if given == ["response_format"] and isinstance(rf, dict) and \
                rf.get("type") in (None, "text"):
            given = []
        if given:
            raise bad_request(given[0], "You can only either use structured outputs or tools, "
                                        f"not both (tool_choice {plan.choice} constrains the "
                                        f"output; remove {given[0]})")
    if plan.choice != "none" and plan.parser and parser_for(plan.parser).keep_special_tokens:
        body.skip_special_tokens = False
    return chars


def tool_constraint(body: Any) -> dict[str, Any] | None:
    """The structured-outputs fields a chat body's tool choice implies, or None."""
    if not getattr(body, "tools", None):
        return None
    plan = chat_plan(body)
    return constraint(plan) if plan is not None else None


def nesting(value: Any) -> int:
    """How deep ``value`` nests dicts and lists (without recursion: a body may nest deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            todo += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


__all__ = ["chat_plan", "check_tools", "tool_constraint"]
