"""Flags of the request surface beyond chat and completions: tool calling (vLLM's names),
the Responses API's store, the tokenizer-info endpoint. ``triptych serve`` and the batch
jobs (in-process app) take the same ones; ``surface_config`` reads them once."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from triptych.api.tools.plan import ToolSettings

DEFAULT_STORE_ENTRIES = 1024
DEFAULT_STORE_BYTES = 64 << 20
FLAGS = ("tool_call_parser", "enable_auto_tool_choice", "responses_store_entries",
         "responses_store_bytes", "enable_tokenizer_info_endpoint")


@dataclass(frozen=True)
class SurfaceConfig:
    tools: ToolSettings = field(default_factory=ToolSettings)
    store_entries: int = DEFAULT_STORE_ENTRIES  # stored responses per tenant
    store_bytes: int = DEFAULT_STORE_BYTES  # their bytes per tenant
    tokenizer_info: bool = False  # GET /tokenizer_info


def add_surface_args(p: argparse.ArgumentParser) -> None:
    from triptych.api.tools.parsers import PARSERS

    t = p.add_argument_group("tool calling (as vLLM's flags)")
    t.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how tool calls are read out of the model's text: hermes "
                        "(<tool_call> JSON: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL3 on a "
                        "Qwen2.5 LM), internlm (<|action_start|><|plugin|>: InternVL on an "
                        "InternLM LM); see docs/tools.md (default: none)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (also what tools without a tool_choice "
                        "mean): the model decides, --tool-call-parser reads its calls; "
                        "without it such requests get 400 (required and named choices "
                        "work either way)")
    r = p.add_argument_group("Responses API (/v1/responses)")
    r.add_argument("--responses-store-entries", type=int, default=DEFAULT_STORE_ENTRIES,
                   help="stored responses (store=true, for previous_response_id and GET) "
                        "per tenant; the oldest is forgotten beyond it")
    r.add_argument("--responses-store-bytes", type=int, default=DEFAULT_STORE_BYTES,
                   help="bytes of stored responses per tenant; the oldest are forgotten "
                        "beyond it, and one larger than this is refused")
    r.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's settings and chat "
                        "template; vLLM's flag)")


def surface_config(args: Any) -> SurfaceConfig:
    """The flags as one object; a bad combination fails in one line."""
    from triptych.cli import fail

    parser = getattr(args, "tool_call_parser", None)
    auto = bool(getattr(args, "enable_auto_tool_choice", False))
    if auto and not parser:
        fail("--enable-auto-tool-choice needs --tool-call-parser")
    entries = getattr(args, "responses_store_entries", DEFAULT_STORE_ENTRIES)
    nbytes = getattr(args, "responses_store_bytes", DEFAULT_STORE_BYTES)
    if entries < 0 or nbytes < 0:
        fail("--responses-store-entries and --responses-store-bytes must be >= 0")
    return SurfaceConfig(ToolSettings(parser, auto), entries, nbytes,
                         bool(getattr(args, "enable_tokenizer_info_endpoint", False)))


__all__ = ["FLAGS", "SurfaceConfig", "add_surface_args", "surface_config"]
