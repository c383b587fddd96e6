"""`triptych chat`: talk to a checkpoint in the terminal (images by local path)."""
from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

_COMMANDS = ("Type a message and press Enter. '/image PATH' attaches an image to your next "
             "message; '/reset' starts a new conversation; '/help' shows this; '/quit', "
             "'/exit' or Ctrl-D quits; Ctrl-C stops an answer, or quits at the prompt.")


def add_parser(subparsers: Any) -> None:
    from triptych.cli import add_engine_args

    p = subparsers.add_parser(
        "chat", help="interactive multi-turn chat in the terminal",
        description="Interactive chat with a checkpoint. " + _COMMANDS + " Without --model "
                    "it falls back to the built-in demo checkpoint (a tiny model trained to "
                    "transcribe printed lines; it reads pages through `triptych ocr`, not "
                    "yet an image attached here: docs/demo-model.md).")
    add_engine_args(p, model_required=False, model_help=(
        "checkpoint directory or Hugging Face hub id (if unset: the built-in demo "
        "checkpoint, a tiny model that transcribes printed lines)"))
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    # Engine stats lines every 10 s would land in the middle of answers.
    p.set_defaults(disable_log_stats=True)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C while the model loads: no traceback
        print()
        return 130


def _run(args: argparse.Namespace) -> int:
    import os

    from triptych.cli import engine_config_from_args, resolve_model
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.llm import LLM
    from triptych.models.demo import demo_checkpoint

    model = resolve_model(args.model) if args.model else None
    if model is None:
        print("no --model given: using the built-in demo checkpoint, a tiny model that "
              "transcribes printed lines. It reads pages through `triptych ocr PAGE`, which "
              "cuts them into the line strips it was trained on; an image attached here with "
              "/image reaches it whole, and it cannot read that yet (docs/demo-model.md).")
        model = demo_checkpoint()
    cfg = engine_config_from_args(args, model=model,
                                  allowed_local_media_path=args.allowed_local_media_path or os.getcwd())
    kw = {k: getattr(cfg, k) for k in cfg.field_names() if k != "model"}
    llm = LLM(model, **kw)
    try:
        return _converse(llm, SamplingParams(temperature=args.temperature,
                                             max_tokens=args.max_tokens))
    finally:
        llm.close()


def _converse(llm: Any, sp: Any) -> int:
    import os

    # From here on only answers and errors reach the terminal: log lines (engine stats,
    # warnings from libraries) would interleave with them.
    logging.getLogger().setLevel(logging.ERROR)
    # Ctrl-C is how a chat stops an answer and quits at the prompt, even when we were
    # started with SIGINT ignored (a parent that ignores it passes that on through exec;
    # Python then installs no KeyboardInterrupt handler and Ctrl-C would do nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    history: list[dict] = []
    pending: list[dict] = []
    print(_COMMANDS)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: quit
            print()
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/help":
            print(_COMMANDS)
            continue
        if line.startswith("/image"):
            path = os.path.abspath(os.path.expanduser(line[6:].strip()))
            if not os.path.isfile(path):
                print(f"no such file: {path}")
                continue
            pending.append({"type": "image_url", "image_url": {"url": "file://" + path}})
            print(f"attached {path} ({len(pending)} image(s) go with your next message)")
            continue
        if line == "/reset":
            history, pending = [], []
            print("(new conversation)")
            continue
        if line.startswith("/") and " " not in line:
            print(f"unknown command {line}; /help lists them")
            continue
        if not line and not pending:
            continue
        history.append({"role": "user", "content": pending + [{"type": "text", "text": line}]})
        pending = []
        try:
            (out,) = _answer(llm, history, sp)
        except ValueError as e:
            print(f"\nerror: {e}")
            history.pop()
            continue
        except KeyboardInterrupt:  # Ctrl-C mid-answer: drop this turn, back to the prompt
            print("(answer stopped)")
            history.pop()
            continue
        text = out.outputs[0].text
        print(text)
        history.append({"role": "assistant", "content": text})


def _answer(llm: Any, history: list[dict], sp: Any) -> list[Any]:
    """One answer; Ctrl-C aborts it between engine steps (the in-process engine) or, with
    worker pools, stops waiting for it."""
    if llm.engine is None:
        print("assistant> ", end="", flush=True)
        return llm.chat(history, sp, use_tqdm=False)
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    print("assistant> ", end="", flush=True)  # NOTE: after the handler: Ctrl-C stops it
    try:
        return llm.chat(history, sp, use_tqdm=False, abort_if=lambda: bool(interrupted))
    finally:
        signal.signal(signal.SIGINT, previous)
