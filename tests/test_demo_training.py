"""The demo model's training data (demo/batches.py, demo/render.py): batching lines by
length keeps every sample and cuts padding; cropped training pages stay aligned with the
glyph teacher's per-token targets; the recipe command runs end to end on a few steps,
also as two data-parallel processes."""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch
from triptych.demo import render
from triptych.demo.batches import Batcher, is_page_step, step_samples
from triptych.models.demo import demo_checkpoint


def args(**kw) -> argparse.Namespace:
    base = dict(steps=100, batch=16, ramp=0.0, pages_from=0.0, page_every=3, bucket=1,
                random_share=0.3, default_font_only=True, crop_pages=False)
    return argparse.Namespace(**{**base, **kw})


def padded(batch: list) -> int:
    """Row slots a batch pads to: its size times its longest sample (text + vision tokens)."""
    return len(batch) * max(len(t) + im.width // render.ROW for im, t, _ in batch)


def test_bucketing_keeps_every_sample_and_cuts_padding() -> None:
    plain = step_samples(0, 8, args(), random.Random(7))
    pooled = step_samples(0, 8, args(bucket=8), random.Random(7))
    pages = [i for i in range(8) if is_page_step(i, args())]
    assert pages == [0, 3, 6]
    # Pages keep their steps and their samples; lines are dealt out again, none lost.
    for i in pages:
        assert [t for _, t, _ in pooled[i]] == [t for _, t, _ in plain[i]]
    lines = [i for i in range(8) if i not in pages]
    assert (Counter(t for i in lines for _, t, _ in pooled[i])
            == Counter(t for i in lines for _, t, _ in plain[i]))
    assert all(len(pooled[i]) == 16 for i in lines)
    assert sum(padded(pooled[i]) for i in lines) < 0.85 * sum(padded(plain[i]) for i in lines)


def test_bucket_one_is_the_plain_per_step_draw() -> None:
    a = args()
    rng = random.Random(3)
    whole = step_samples(0, 4, a, rng)
    rng = random.Random(3)
    one_by_one = [s for step in range(4) for s in step_samples(step, step + 1, a, rng)]
    assert [[t for _, t, _ in s] for s in whole] == [[t for _, t, _ in s] for s in one_by_one]


def test_cropped_pages_keep_the_glyph_targets_aligned() -> None:
    """A cropped page ends on a token row, holds all its text, and the processor keeps its
    size, so the teacher's rows of per-token characters match the vision tokens."""
    proc = Batcher(demo_checkpoint()).proc
    rng = random.Random(11)
    heights = set()
    for _ in range(20):
        cols: list = []
        img, text = render.sample_page(rng, n_lines=3, max_chars=20, width=308, crop=True,
                                       columns=cols)
        heights.add(img.height)
        assert img.height % render.ROW == 0 and len(cols) == img.height // render.ROW
        assert all(len(row) == img.width // render.ROW for row in cols)
        # Every printed character of the text is in the kept rows.
        assert sum(len(c) for row in cols for c in row) == sum(
            ch in render.CHARSET and ch != " " for ch in text)
        grid = proc(images=[img], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert grid == [1, img.height // 14, img.width // 14]
    assert len(heights) > 3  # several shapes, not one


def test_training_command_runs_a_few_steps(tmp_path) -> None:
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "triptych.demo.train", "--out", str(out),
                        "--steps", "6", "--batch", "8", "--pages-from", "0", "--page-every", "2",
                        "--crop-pages", "--bucket", "3", "--eval-every", "0", "--eval-lines", "1",
                        "--eval-pages", "1", "--eval-dev", "1", "--log-every", "1", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("loss") == 6
    result = json.loads((out / "training.json").read_text())
    (phase,) = result["phases"]
    assert phase["bucket"] == 3 and phase["crop_pages"] is True
    assert 0 <= result["heldout_cer"] and 0 <= result["heldout_page_cer"]
    assert (out / "model.safetensors").exists()


def _run(out, *flags: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "triptych.demo.train", "--out", str(out),
                        "--steps", "4", "--lr", "0.02", "--pages-from", "0", "--page-every", "2",
                        "--crop-pages", "--eval-every", "0", "--eval-lines", "1",
                        "--eval-pages", "1", "--eval-dev", "1", "--threads", "1", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "training.json").read_text())


def test_two_training_processes_train_on_one_process_samples(tmp_path) -> None:
    """--procs 2: the ranks split one process's samples and average their token-weighted
    gradients, so their weights are one process's up to rounding (far closer than another
    seed's: rank 1's share counts as it should), a rerun gives the same weights bit for
    bit, and no rank is left."""
    from safetensors.torch import load_file

    two = _run(tmp_path / "two", "--batch", "16", "--procs", "2")
    assert two["phases"][0]["procs"] == 2 and two["phases"][0]["batch"] == 16
    _run(tmp_path / "again", "--batch", "16", "--procs", "2")
    _run(tmp_path / "one", "--batch", "16")
    _run(tmp_path / "seed", "--batch", "16", "--seed", "1")
    assert ((tmp_path / "two" / "model.safetensors").read_bytes()
            == (tmp_path / "again" / "model.safetensors").read_bytes())
    w = {d: load_file(str(tmp_path / d / "model.safetensors")) for d in ("two", "one", "seed")}

    def apart(a: str, b: str) -> float:
        num = sum(float((w[a][k] - w[b][k]).norm() ** 2) for k in w[a])
        return (num / sum(float(w[a][k].norm() ** 2) for k in w[a])) ** 0.5

    assert apart("two", "one") < 1e-3 and apart("two", "seed") > 100 * apart("two", "one"), \
        (apart("two", "one"), apart("two", "seed"))
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_recipe_seed_is_another_draw(tmp_path) -> None:
    """--recipe --seed N adds N to every phase's seed (another draw of the recipe); without
    it the phases keep RECIPE's seeds; --from-phase N --init (phase N-1's weights) runs the
    rest of the recipe, to the same weights. A two-phase recipe of a few steps stands in for the
    shipped one (patched into a child process: nothing in this process changes)."""
    def recipe(out, *flags: str) -> dict:
        few = "batch=4, eval_lines=1, eval_pages=1, eval_dev=1"
        code = ("import sys; from triptych.demo import train; train.RECIPE[:] = ["
                f"dict(steps=2, {few}), dict(steps=2, {few}, pages_from=0.0, seed=1)]; "
                "train.main(sys.argv[1:])")
        r = subprocess.run([sys.executable, "-c", code, "--recipe", "--out", str(out),
                            "--eval-every", "0", "--threads", "1", *flags],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((out / "training.json").read_text())

    base, other = recipe(tmp_path / "base"), recipe(tmp_path / "other", "--seed", "5")
    assert [p["seed"] for p in base["phases"]] == [0, 1]
    assert [p["seed"] for p in other["phases"]] == [5, 6]
    weights = (tmp_path / "base" / "model.safetensors").read_bytes()
    assert weights != (tmp_path / "other" / "model.safetensors").read_bytes()
    # --from-phase 2 from phase 1's weights is the rest of the same recipe, bit for bit.
    rest = recipe(tmp_path / "rest", "--from-phase", "2", "--init",
                  str(tmp_path / "base" / "phase-1"))
    assert [p["seed"] for p in rest["phases"]] == [0, 1]  # phase 1's record came along
    assert (tmp_path / "rest" / "model.safetensors").read_bytes() == weights
    assert not (tmp_path / "rest" / "phase-1").exists()


def test_ranks_weighted_by_their_tokens_give_the_whole_batch_gradient() -> None:
    """--procs N: each rank scales its mean losses by its share of the step's label tokens
    and glyph targets (demo/ddp.py), so the ranks' averaged gradient is the gradient one
    process takes over the whole batch; an unweighted mean of the ranks' means is not."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from triptych.demo import ddp
    from triptych.demo.batches import make_inputs
    from triptych.demo.teacher import TokenTargets

    torch.manual_seed(0)
    batcher = Batcher(demo_checkpoint())
    model = Qwen2VLForConditionalGeneration.from_pretrained(demo_checkpoint(),
                                                            dtype=torch.float32)
    teacher = TokenTargets(model)
    params = list(model.parameters()) + list(teacher.head.parameters())
    samples = step_samples(1, 2, args(batch=8, random_share=0.5), random.Random(5))[0]

    def grad(chunks: list, w: list | None = None) -> tuple:
        rng, total, cnt = random.Random(9), 0, []
        for i, chunk in enumerate(chunks):  # one prompt stream, as the whole batch draws it
            _, batch, targets = make_inputs(chunk, batcher, teacher, rng, model)
            for p in params:
                p.grad = None
            out = model(**batch)
            aux, _ = teacher.loss(targets)
            s = w[i] if w else [1.0, 1.0]
            (out.loss * s[0] + aux * s[1]).backward()
            total = total + torch.cat([p.grad.reshape(-1) for p in params]) / len(chunks)
            cnt.append(ddp.counts(batch, targets))
        return total, cnt

    whole, _ = grad([samples])
    plain, cnt = grad([samples[:4], samples[4:]])  # two ranks, their means averaged
    assert cnt[0] != cnt[1]
    summed = [a + b for a, b in zip(*cnt)]
    weighted, _ = grad([samples[:4], samples[4:]], [ddp.shares(c, summed, 2) for c in cnt])
    err = lambda g: float((g - whole).norm() / whole.norm())  # noqa: E731
    assert err(weighted) < 1e-5 and err(plain) > 100 * err(weighted), (err(weighted), err(plain))


def test_device_flag_refuses_what_cannot_run(tmp_path) -> None:
    """--device cuda on a box without a GPU, and --procs over gloo with a GPU, each fail
    before any work with a line saying what to use instead."""
    base = [sys.executable, "-m", "triptych.demo.train", "--out", str(tmp_path / "x"),
            "--steps", "1", "--threads", "1"]
    r = subprocess.run(base + ["--procs", "2", "--batch", "16", "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--procs above 1" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run(base + ["--device", "cuda"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "torch sees no GPU" in r.stderr and "--device cpu" in r.stderr
    assert not (tmp_path / "x").exists()  # refused before building anything


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_the_gpu(tmp_path) -> None:
    """A few steps on the GPU (--device auto picks it): the loss is finite, training.json
    names the device, and the checkpoint reads through HF on the CPU as trained."""
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "triptych.demo.train", "--out", str(out),
                        "--steps", "6", "--batch", "16", "--pages-from", "0", "--page-every", "3",
                        "--crop-pages", "--strips", "0.5", "--eval-every", "0", "--eval-lines",
                        "2", "--eval-pages", "1", "--eval-dev", "2", "--log-every", "1",
                        "--threads", "1", "--device", "auto"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split()[3]) for line in r.stdout.splitlines() if " loss " in line]
    assert len(losses) == 6 and all(math.isfinite(v) and v < 100 for v in losses)
    result = json.loads((out / "training.json").read_text())
    assert result["phases"][0]["device"] == "cuda"
    assert 0 <= result["heldout_cer"]



def test_training_strips_do_not_follow_the_ocr_layout_settings(monkeypatch) -> None:
    """Training cuts its strips with the settings the shipped phases were trained with
    (augment.CUT), so retuning `triptych ocr`'s layout step leaves the recipe's draw as it
    was (it once moved every phase from step ~1: the data changed under the recipe)."""
    from triptych.demo import augment
    from triptych.demo.layout import lines as layout

    def draw() -> list[tuple[bytes, str, list]]:
        rng, out = random.Random(3), []
        for _ in range(12):
            cols: list = []
            img, text = augment.sample(rng, 40, columns=cols)
            out.append((img.tobytes(), text, cols))
        return out

    before = draw()
    for name, value in (("MAX_WIDTH", 120), ("MARGIN", 2), ("WORD_GAP", 0.9)):
        monkeypatch.setattr(layout, name, value)
    assert draw() == before
