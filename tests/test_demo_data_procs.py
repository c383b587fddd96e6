"""The training's batches drawn by processes of their own (demo/data_procs.py, ``--data-procs``):
the same batches, bit for bit, whatever the number of processes, and those the draw makes in
this process (the pipe loses nothing); a process that dies fails the training with a clear
error instead of a wait; the training command runs on them and leaves no process behind."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
import torch
from triptych.demo import data_procs
from triptych.demo.batches import Batcher
from triptych.models.demo import demo_checkpoint


def args(out: str, **kw) -> argparse.Namespace:
    base = dict(out=out, steps=5, max_steps=0, batch=6, ramp=0.0, pages_from=0.0, page_every=3,
                bucket=2, random_share=0.3, default_font_only=True, crop_pages=True, strips=0.5,
                seed=3, data_procs=1, procs=1, rank=0, device="cpu")
    return argparse.Namespace(**{**base, **kw})


def drawn(a: argparse.Namespace) -> list[tuple[dict, torch.Tensor]]:
    return [(batch, targets) for _, batch, targets in data_procs.items(a)]


def same(x: list, y: list) -> bool:
    return len(x) == len(y) and all(
        bx.keys() == by.keys() and all(torch.equal(bx[k], by[k]) for k in bx)
        and torch.equal(tx, ty) for (bx, tx), (by, ty) in zip(x, y))


def test_any_number_of_data_processes_draws_the_same_batches(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(demo_checkpoint(), ckpt)
    one, two = drawn(args(ckpt)), drawn(args(ckpt, data_procs=2))
    assert len(one) == 5 and same(one, two)
    # What came through the pipes is what the draw makes here, step for step.
    from transformers import Qwen2VLForConditionalGeneration

    batcher = Batcher(ckpt)
    model = Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    here = [item for g in range(3) for item in data_procs.group_items(g, args(ckpt), batcher, model)]
    assert same(one, here)
    assert {"position_ids", "pixel_values", "labels"} <= one[0][0].keys()
    # Each step's own draw: steps differ, and another seed draws other batches.
    assert not torch.equal(one[0][1], one[1][1])
    other = list(data_procs.group_items(0, args(ckpt, seed=4), batcher, model))
    assert not same(one[:2], other)


def test_a_data_process_that_fails_fails_the_training_clearly(tmp_path) -> None:
    """Processes that cannot load the checkpoint end at once: the reader raises naming the
    process and its exit code (no wait for a batch that never comes), and none is left."""
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    with pytest.raises(RuntimeError, match=r"data process 0 of 2 ended .*exit code 1"):
        drawn(args(str(bad), data_procs=2))
    left = subprocess.run(["pgrep", "-f", str(bad)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_training_on_data_processes(tmp_path) -> None:
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "triptych.demo.train", "--out", str(out),
                        "--steps", "4", "--batch", "8", "--pages-from", "0", "--page-every", "2",
                        "--crop-pages", "--eval-every", "0", "--eval-lines", "1",
                        "--eval-pages", "1", "--eval-dev", "1", "--log-every", "1",
                        "--threads", "1", "--data-procs", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" loss ") == 4
    assert json.loads((out / "training.json").read_text())["phases"][0]["data_procs"] == 2
    left = subprocess.run(["pgrep", "-f", "triptych.demo.data_procs.*" + str(out)],
                          capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
    refused = subprocess.run([sys.executable, "-m", "triptych.demo.train", "--out",
                              str(tmp_path / "x"), "--procs", "2", "--batch", "16",
                              "--data-procs", "2"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--data-procs" in refused.stderr
