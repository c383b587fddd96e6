"""Tool calling (vLLM's surface): a request's tools checked into a plan (``plan.py``), the
output constrained for ``required`` / named choices, and the model's text read back as
``tool_calls`` by the parser of its family, whole or streamed (``parsers.py``,
``reader.py``, ``json_scan.py``); assistant and tool turns as templates read them
(``messages.py``)."""
from __future__ import annotations

from triptych.api.tools.parsers import PARSERS, parser_for
from triptych.api.tools.plan import ToolPlan, ToolSettings, constraint, plan_tools
from triptych.api.tools.reader import ToolReader

__all__ = ["PARSERS", "ToolPlan", "ToolReader", "ToolSettings", "constraint", "parser_for",
           "plan_tools"]
