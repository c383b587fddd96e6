"""A request's tools, checked: what the template renders, what constrains the output, how the
answer is read back.

    tools + tool_choice (+ parallel_tool_calls)  --plan_tools-->  ToolPlan | None

vLLM's rules (``check_tool_usage`` and serving_chat), in its words where clients match them:

    tools: []                                   400: must not be an empty array
    tool_choice absent or null, with tools      "auto"
    tool_choice set (not "none"), no tools      400: When using `tool_choice`, `tools` must be set.
    tool_choice "auto" without the server's     400 naming --enable-auto-tool-choice and
      --enable-auto-tool-choice --tool-call-parser   --tool-call-parser
    named function not among the tools          400
    "none"                                      tools rendered, output read as plain text

``required`` and a named function constrain the output through structured outputs
(``constraint``): a named call's output is its arguments object; ``required``'s is a JSON
array of ``{"name", "parameters"}`` objects, one per call (vLLM's schema), so even a model
that never learnt the format produces valid calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from triptych.api.errors import bad_request

MAX_TOOLS = 128  # function definitions per request
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names (plus . and :)
USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags."""

    parser: str | None = None  # --tool-call-parser (api/tools/parsers.py)
    auto: bool = False  # --enable-auto-tool-choice


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None = None

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI chat shape, as chat templates receive ``tools``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only
    parser: str | None = None  # the server's parser ("auto" reads the text with it)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [f.as_tool() for f in self.functions] or None


def _function(tool: Any, i: int, flat: bool) -> Function:
    """One tool definition: chat's ``{"type", "function": {...}}`` or, ``flat`` (the
    Responses API), ``{"type", "name", ...}``."""
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(where, f"{where}: only function tools are supported "
                                 '({"type": "function", ...})')
    fn = tool if flat else tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function", f"{where}.function must be an object with "
                                               "a name")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{where}.function.name", f"{where}: a function name is 1-64 "
                                                    "letters, digits, '_', '-', '.' or ':'")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters", f"{where}: parameters must be a "
                                                          "JSON schema object")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{where}.function.description", f"{where}: description must be "
                                                           "a string")
    strict = fn.get("strict", tool.get("strict"))
    return Function(name, desc, params, strict if isinstance(strict, bool) else None)


def _named(choice: dict[str, Any], flat: bool) -> str:
    """The function a named tool_choice names (chat: ``{"type", "function": {"name"}}``,
    Responses: ``{"type", "name"}``)."""
    fn = choice if flat and "function" not in choice else choice.get("function")
    if not isinstance(fn, dict):
        raise bad_request("tool_choice", f"Invalid value for `function`: `{fn}` in "
                                         f"`tool_choice`! {USAGE}"[:300])
    if "name" not in fn:
        raise bad_request("tool_choice", f"Expected field `name` in `function` in "
                                         f"`tool_choice`! {USAGE}")
    name = fn["name"]
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice", f"Invalid `name` in `function`: `{str(name)[:64]}` "
                                         f"in `tool_choice`! {USAGE}")
    return name


def plan_tools(tools: Any, tool_choice: Any, parallel: bool | None, settings: ToolSettings,
               *, flat: bool = False, choice_given: bool = True) -> ToolPlan | None:
    """Check a request's tool fields; None when it has no tools (and asks for none).
    ``flat``: Responses API shapes. Raises APIError (400) naming the field."""
    if tools == []:
        raise bad_request("tools", "`tools` must not be an empty array. Either provide at "
                                   "least one tool or omit the field entirely.")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools", "`tools` must be a list of tool definitions")
    if tool_choice is None or not choice_given:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        choice, named = "none", None
    elif tools is None:
        raise bad_request("tool_choice", "When using `tool_choice`, `tools` must be set.")
    elif tool_choice in ("auto", "required"):
        choice, named = tool_choice, None
    elif isinstance(tool_choice, dict):
        choice, named = "named", _named(tool_choice, flat)
    else:
        raise bad_request("tool_choice", f"Invalid value for `tool_choice`: "
                                         f"{str(tool_choice)[:64]}! Only named tools, "
                                         '"none", "auto" or "required" are supported.')
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"{len(tools)} tools; at most {MAX_TOOLS} per request")
    functions = tuple(_function(t, i, flat) for i, t in enumerate(tools))
    if named is not None and named not in {f.name for f in functions}:
        raise bad_request("tool_choice", "The tool specified in `tool_choice` does not match "
                                         "any of the specified `tools`")
    if choice == "auto" and not (settings.auto and settings.parser):
        raise bad_request("tool_choice", '"auto" tool choice requires '
                                         "--enable-auto-tool-choice and --tool-call-parser "
                                         "to be set")
    return ToolPlan(functions, choice, named, parallel is not False, settings.parser)


def _parameters(f: Function) -> dict[str, Any]:
    # NOTE: a function without parameters takes exactly {} (vLLM's reading of None / {}).
    if not f.parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {k: v for k, v in f.parameters.items() if k != "$defs"}


def constraint(plan: ToolPlan) -> dict[str, Any] | None:
    """``structured_outputs`` fields forcing valid calls (required / named), or None."""
    if plan.choice == "named":
        f = next(f for f in plan.functions if f.name == plan.named)
        schema = dict(_parameters(f))
        if f.parameters and "$defs" in f.parameters:
            schema["$defs"] = f.parameters["$defs"]
    elif plan.choice == "required":
        defs: dict[str, Any] = {}
        for f in plan.functions:
            for k, v in ((f.parameters or {}).get("$defs") or {}).items():
                if k in defs and defs[k] != v:
                    raise bad_request("tools", f"tools define $defs.{k[:40]} twice, "
                                               "differently")
                defs[k] = v
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f.name]},
                                 "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in plan.functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not plan.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
    else:
        return None
    # NOTE: no free whitespace (a weak model must not spend its tokens on indentation) and
    # no properties the schema does not name (OpenAI's strict function calling; vLLM's
    # xgrammar default): a call is exactly what the definition allows.
    return {"json": schema, "disable_any_whitespace": True,
            "disable_additional_properties": True}


def tools_chars(tools: Any) -> int:
    """What the tool definitions add to the prompt, in characters (the prompt-size check
    counts it before anything is rendered)."""
    return len(json.dumps(tools)) if tools else 0


__all__ = [
    "MAX_TOOLS",
    "Function",
    "ToolPlan",
    "ToolSettings",
    "constraint",
    "plan_tools",
    "tools_chars",
]
