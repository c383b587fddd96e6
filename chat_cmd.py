"""`triptych chat`: talk to a checkpoint in the terminal (images by local path)."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    from triptych.cli import add_engine_args

    p = subparsers.add_parser(
        "chat", help="interactive multi-turn chat in the terminal",
        description="Interactive chat. Type a message; '/image PATH' attaches an image to the "
                    "next message; '/reset' starts over; Ctrl-D quits.")
    add_engine_args(p, model_required=False)
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")


def run(args: argparse.Namespace) -> int:
    import os

    from triptych.cli import engine_config_from_args
    from triptych.engine.sampling_params import SamplingParams
    from triptych.llm import LLM
    from triptych.models.demo import DEMO_FLAGS, tiny_checkpoint

    model = args.model or tiny_checkpoint("qwen2_vl", **DEMO_FLAGS)
    cfg = engine_config_from_args(args, model=model,
                                  allowed_local_media_path=args.allowed_local_media_path or os.getcwd())
    kw = {k: getattr(cfg, k) for k in cfg.field_names() if k != "model"}
    llm = LLM(model, **kw)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    history: list[dict] = []
    pending: list[dict] = []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return 0
        if line.startswith("/image "):
            path = os.path.abspath(line[7:].strip())
            pending.append({"type": "image_url", "image_url": {"url": "file://" + path}})
            continue
        if line == "/reset":
            history, pending = [], []
            continue
        history.append({"role": "user", "content": pending + [{"type": "text", "text": line}]})
        pending = []
        try:
            (out,) = llm.chat(history, sp, use_tqdm=False)
        except ValueError as e:
            print(f"error: {e}")
            history.pop()
            continue
        text = out.outputs[0].text
        print(f"assistant> {text}")
        history.append({"role": "assistant", "content": text})
