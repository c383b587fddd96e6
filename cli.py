"""`triptych` command line: serve | chat | make-tiny | bench.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and
``run(args)``; they are imported lazily so `triptych --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import typing
from typing import Any

from triptych.config import EngineConfig

# subcommand -> (module holding add_parser/run, one-line help)
SUBCOMMANDS = {
    "serve": ("triptych.api.serve_cmd", "OpenAI-compatible HTTP server (chat, completions, metrics)"),
    "chat": ("triptych.chat_cmd", "interactive multi-turn chat in the terminal"),
    "make-tiny": ("triptych.models.tiny", "write a tiny random HF-format checkpoint (tests, demos)"),
    "bench": ("triptych.bench", "benchmarks: offline throughput vs HF, serving load"),
    "keys": ("triptych.connector.keys_cmd", "make CURVE keypairs for pool workers across hosts"),
    "worker": ("triptych.engine.worker_cmd", "a pool worker on another host (joins a router)"),
}

_HELP_SKIP = {"model"}


def _field_help() -> dict[str, str]:
    """Knob help text = the field comments of EngineConfig (one source of truth)."""
    import inspect
    src = inspect.getsource(EngineConfig)
    out = {}
    for line in src.splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith(("#", "def", '"')):
            name = line.split(":")[0].strip()
            out[name] = line.split("#", 1)[1].strip()
    return out


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Every EngineConfig knob as --kebab-case, defaults read from the dataclass."""
    helps = _field_help()
    hints = typing.get_type_hints(EngineConfig)
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, default=None,
                   help="checkpoint directory (HF format: config.json, *.safetensors, tokenizer)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _HELP_SKIP:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        h = f"{helps.get(f.name, '')} (default: {default})"
        hint = hints[f.name]
        if hint is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=h)
        elif f.name == "tensor_parallel_size":
            g.add_argument(flag, "-tp", type=int, default=default, help=h)
        elif hint is int:
            g.add_argument(flag, type=int, default=default, help=h)
        elif hint is float:
            g.add_argument(flag, type=float, default=default, help=h)
        elif f.name == "limit_mm_per_prompt":
            g.add_argument(flag, type=str, default=None,
                           help=h + ". JSON, e.g. '{\"image\": 4, \"video\": 1}'")
        elif f.name in ("max_model_len", "num_kv_blocks", "cpu_threads") or \
                f.name.endswith("_tensor_parallel_size"):
            g.add_argument(flag, type=int, default=default, help=h)
        else:
            g.add_argument(flag, type=str, default=default, help=h)


def engine_config_from_args(args: argparse.Namespace, **override: Any) -> EngineConfig:
    kw = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    if kw.get("limit_mm_per_prompt") is None:
        kw.pop("limit_mm_per_prompt", None)
    kw.update(override)
    return EngineConfig(**kw)


def _early_cpu_threads(argv: list[str]) -> int | None:
    """``--cpu-threads N`` read before argparse runs, so the OpenMP wait policy and thread
    count reach the environment before any subcommand module imports torch."""
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--cpu-threads=") else (
            argv[i + 1] if a == "--cpu-threads" and i + 1 < len(argv) else None)
        if value is not None:
            return int(value) if value.isdigit() and int(value) > 0 else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from triptych.engine.threads import apply_thread_policy, early_env

    early_env(_early_cpu_threads(argv))  # before torch is imported anywhere
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(
        prog="triptych", description="triptych: a multimodal-first LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (modname, help_text) in SUBCOMMANDS.items():
        # Only the chosen subcommand's module is imported (others just list a stub).
        if argv and argv[0] == name:
            modules[name] = importlib.import_module(modname)
            modules[name].add_parser(sub)
        else:
            sub.add_parser(name, help=f"{help_text} (see `triptych {name} --help`)")
    args = parser.parse_args(argv)
    mod = modules.get(args.command)
    if mod is None:
        parser.error(f"unknown command {args.command}")
    apply_thread_policy(getattr(args, "cpu_threads", None))
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
