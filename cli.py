"""`triptych` command line: serve | chat | make-tiny | bench.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and
``run(args)``; they are imported lazily so `triptych --help` stays fast. Every subcommand's
``--help`` shows each default once (``HelpFormatter``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import re
import sys
import typing
from typing import Any, NoReturn

from triptych.config import EngineConfig

# subcommand -> (module holding add_parser/run, one-line help)
SUBCOMMANDS = {
    "serve": ("triptych.api.serve_cmd", "OpenAI-compatible HTTP server (chat, completions, metrics)"),
    "chat": ("triptych.chat_cmd", "interactive multi-turn chat in the terminal"),
    "make-tiny": ("triptych.models.tiny", "write a tiny random HF-format checkpoint (tests, demos)"),
    "bench": ("triptych.bench.throughput", "benchmarks: offline throughput vs HF, serving load"),
    "keys": ("triptych.connector.keys_cmd", "make CURVE keypairs for pool workers across hosts"),
    "worker": ("triptych.worker.remote_cmd", "a pool worker on another host (joins a router)"),
    "run-batch": ("triptych.jobs.run_batch", "run an OpenAI batch file (JSONL) through the engine"),
    "ocr": ("triptych.jobs.ocr", "transcribe images, folders and PDFs page by page"),
}

_HELP_SKIP = {"model"}
# EngineConfig field -> (vLLM's flag, our older spelling kept as an alias)
FLAG_SPELLINGS = {
    "num_kv_blocks": ("--num-gpu-blocks-override", "--num-kv-blocks"),
    "kv_cache_memory": ("--kv-cache-memory", "--kv-cache-memory-bytes"),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    # SGLang's spellings: --disable-cuda-graph, --cuda-graph-max-bs
    "enforce_eager": ("--enforce-eager", "--disable-cuda-graph"),
    "max_cudagraph_capture_size": ("--max-cudagraph-capture-size", "--cuda-graph-max-bs"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` once: not when the help already says its default, nor for
    required options, switches, or options without a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or "(default" in text or action.required
                or action.default is None or action.default == argparse.SUPPRESS
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse._StoreConstAction, argparse._HelpAction))):
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """Every subcommand's parser: HelpFormatter also replaces argparse's
    ArgumentDefaultsHelpFormatter, which repeats defaults that the help already states."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("formatter_class") in (None, argparse.ArgumentDefaultsHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2 (argparse's convention), no traceback."""
    print(f"triptych: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def resolve_model(model: str) -> str:
    """A checkpoint directory for ``--model``: the directory itself, or, for a hub id such as
    ``Qwen/Qwen2-VL-2B-Instruct``, its copy in the Hugging Face cache (downloaded first when
    the hub can be reached, as vLLM does). Anything else fails in one line, before any
    process starts."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            fail(f"--model {model}: the directory has no config.json (not a Hugging Face "
                 "checkpoint directory)")
        return path
    if os.path.exists(path):
        fail(f"--model {model}: is a file; give the checkpoint's directory")
    if not _HUB_ID.match(model):
        fail(f"--model {model}: no such directory")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        fail(f"--model {model}: no such directory (and huggingface_hub is not installed to "
             "fetch it from the hub)")
    try:  # already in the cache: no network
        return snapshot_download(model, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hint = (f"download it where the hub is reachable (`hf download {model}`), then pass "
            "--model /path/to/the/directory or copy the Hugging Face cache here")
    if offline:
        fail(f"--model {model}: no such directory, and it is not in the Hugging Face cache "
             f"(HF_HUB_OFFLINE is set): {hint}")
    logging.getLogger("triptych").info("downloading %s from the Hugging Face hub", model)
    try:
        return snapshot_download(model, allow_patterns=[
            "*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"])
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one line
        if hub_says_no_such_model(e):
            fail(f"--model {model}: no such directory, and the Hugging Face hub has no such "
                 "model (or it needs a login: set HF_TOKEN)")
        fail(f"--model {model}: no such directory, and the Hugging Face hub cannot be "
             f"reached ({_root_cause(e)}): {hint}")


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (``__cause__`` / ``__context__``)."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _root_cause(e: BaseException) -> str:
    return type(_causes(e)[-1]).__name__


def hub_says_no_such_model(e: BaseException) -> bool:
    """True only when the hub answered and said the repository (or revision) is missing or
    gated. NOTE: huggingface_hub reports an unreachable hub as ``LocalEntryNotFoundError``
    ("not in the local cache") raised from the connection error, so a name containing
    "NotFound" says nothing about the hub: only an HTTP answer does."""
    try:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:  # pragma: no cover - resolve_model checked the import
        return False
    return any(isinstance(c, (RepositoryNotFoundError, RevisionNotFoundError))
               for c in _causes(e))


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


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True,
                    model_help: str | None = None) -> None:
    """Every EngineConfig knob as --kebab-case (vLLM's spelling), defaults read from the
    dataclass."""
    helps = _field_help()
    hints = typing.get_type_hints(EngineConfig)
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, default=None, help=model_help or (
        "checkpoint directory (HF format: config.json, *.safetensors, tokenizer) or a "
        "Hugging Face hub id such as Qwen/Qwen2-VL-2B-Instruct (downloaded to the HF cache)"))
    for f in dataclasses.fields(EngineConfig):
        if f.name in _HELP_SKIP:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flags = FLAG_SPELLINGS.get(f.name, ("--" + f.name.replace("_", "-"),))
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": helps.get(f.name, "")}
        hint = hints[f.name]
        if hint is bool or f.name == "async_scheduling":  # (bool | None: None is "auto")
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif hint is int or f.name in ("max_model_len", "num_kv_blocks", "cpu_threads",
                                       "max_cudagraph_capture_size") or \
                f.name.endswith("_tensor_parallel_size"):
            g.add_argument(*flags, type=int, **kw)
        elif hint is float or f.name.endswith("_gpu_memory_utilization"):
            g.add_argument(*flags, type=float, **kw)
        elif f.name == "limit_mm_per_prompt":
            kw["default"] = None
            kw["help"] += f"; JSON, e.g. '{{\"image\": 4, \"video\": 1}}' (default: " \
                          f"{json.dumps(default)})"
            g.add_argument(*flags, type=str, **kw)
        else:
            g.add_argument(*flags, type=str, **kw)


def engine_config_from_args(args: argparse.Namespace, **override: Any) -> EngineConfig:
    kw = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    if kw.get("limit_mm_per_prompt") is None:
        kw.pop("limit_mm_per_prompt", None)
    kw.update(override)
    try:
        return EngineConfig(**kw)
    except (ValueError, TypeError) as e:
        fail(str(e))


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
    from triptych.worker.threads import apply_thread_policy, early_env

    early_env(_early_cpu_threads(argv))  # before torch is imported anywhere
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = ArgumentParser(
        prog="triptych", description="triptych: a multimodal-first LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
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
    # NOTE: `serve`'s process (P0) runs no engine steps: glibc's own allocator thresholds.
    # A command whose engine runs on a GPU keeps torch's thread and allocator defaults.
    from triptych.engine.device.platform import applies_host_policies

    if args.command == "serve" or applies_host_policies(getattr(args, "device", None) or "auto"):
        apply_thread_policy(getattr(args, "cpu_threads", None), steps=args.command != "serve")
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
