"""The training's batches made by processes of their own (``--data-procs N``, demo/train.py).

Drawing a step (rendering, the layout step, the image processor, the prompt's positions)
takes one core ~0.1 s for a batch of the last phase, while its forward and backward on a
GPU take a few milliseconds: one drawing thread would leave a GPU idle nine tenths of the
time. With N processes the steps are drawn side by side, and the training reads them in
step order.

- **The same batches whatever N.** Each group of steps (``--bucket`` steps, else one) is
  drawn from its own generator, seeded by (seed, group), and group g is drawn by process
  g mod N. So 1, 4 or 16 processes give the training the same batches, bit for bit: a
  draw of its own, not the one stream of ``--data-procs 0`` (the shipped recipe's).
- **Nothing pickled.** A process writes each step's inputs to a pipe as safetensors bytes
  behind their length (its own standard output; what libraries print goes to stderr).
- **No process left.** One that ends early fails the training with its exit code (its
  error is printed above); the training's end, or its failure, stops them all.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
from typing import Any, Iterator

TARGETS = "__glyph_targets__"  # the glyph teacher's targets, beside the model's inputs


def group_rng(seed: int, group: int) -> random.Random:
    """The generator of one group of steps (a str seed: the same on every Python)."""
    return random.Random(f"triptych-demo-data:{seed}:{group}")


def group_items(g: int, args: argparse.Namespace, batcher: Any, model: Any
                ) -> Iterator[tuple[dict[str, Any], Any]]:
    """(model inputs, glyph targets) of each step of group ``g``."""
    from triptych.demo.batches import make_inputs, step_groups, step_samples
    from triptych.demo.teacher import TokenTargets

    total, size, _ = step_groups(args)
    rng = group_rng(args.seed, g)
    for samples in step_samples(g * size, min((g + 1) * size, total), args, rng):
        _, batch, targets = make_inputs(samples, batcher, TokenTargets, rng, model)
        yield batch, targets


def encode(batch: dict[str, Any], targets: Any) -> bytes:
    from safetensors.torch import save

    return save({**{k: v.contiguous() for k, v in batch.items()}, TARGETS: targets.contiguous()})


def decode(data: bytes) -> tuple[dict[str, Any], Any]:
    from safetensors.torch import load

    batch = load(data)
    return batch, batch.pop(TARGETS)


def items(args: argparse.Namespace) -> Iterator[tuple[None, dict[str, Any], Any]]:
    """Every step's (None, inputs, targets), in step order, from ``args.data_procs``
    processes started here (demo/train.py's ``prefetch`` reads them on its thread)."""
    n = args.data_procs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    spec = json.dumps(vars(args))
    procs = [subprocess.Popen([sys.executable, "-m", "triptych.demo.data_procs", "--args-json",
                               spec, "--index", str(i), "--count", str(n)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
             for i in range(n)]
    from triptych.demo.batches import step_groups

    try:
        total, size, count = step_groups(args)
        for g in range(count):
            for _ in range(min(size, total - g * size)):
                head = _read(procs, g % n, 8)
                batch, targets = decode(_read(procs, g % n, struct.unpack("<Q", head)[0]))
                yield None, batch, targets
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            p.stdout.close()


def _read(procs: list[Any], i: int, n: int) -> bytes:
    """``n`` bytes from process ``i``; a clear error when it ended first."""
    out = bytearray()
    while len(out) < n:
        chunk = procs[i].stdout.read(n - len(out))
        if not chunk:
            try:
                code = procs[i].wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"data process {i} of {len(procs)} ended before its batch "
                               f"(exit code {code}; its error, if any, is above)")
        out += chunk
    return bytes(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one of --data-procs: draws its share of the "
                                "training's steps and writes them to its standard output")
    p.add_argument("--args-json", required=True, help="the training's arguments")
    p.add_argument("--index", type=int, required=True, help="this process's number")
    p.add_argument("--count", type=int, required=True, help="how many draw")
    a = p.parse_args(argv)
    frames = os.fdopen(os.dup(1), "wb")  # the batches' pipe; anything printed -> stderr
    os.dup2(2, 1)
    args = argparse.Namespace(**json.loads(a.args_json))

    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from triptych.demo.batches import Batcher, step_groups

    torch.set_num_threads(1)
    batcher = Batcher(args.out)
    # Only for its get_rope_index (the prompts' positions): the weights are not used.
    model = Qwen2VLForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32)
    try:
        for g in range(a.index, step_groups(args)[2], a.count):
            for batch, targets in group_items(g, args, batcher, model):
                data = encode(batch, targets)
                frames.write(struct.pack("<Q", len(data)))
                frames.write(data)
                frames.flush()
    except BrokenPipeError:  # the training ended first
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
