"""Train the demo OCR model: ``python -m triptych.demo.train --out DIR`` (docs/demo-model.md).

A Qwen2-VL-shaped checkpoint (models/tiny.py's builder, so the engine serves it as any
Qwen2-VL) with a character-level tokenizer, trained from scratch on synthetic printed lines
and short pages (demo/render.py). Every batch goes through the same HF image processor and
chat template the engine uses (api/processor.py), so the served model sees what it learned
on. Seeded; threads set on purpose (``--threads``). Ends with the held-out CER.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from typing import Any

from triptych.demo import data_procs, ddp, template
from triptych.demo.batches import PHRASES, Batcher, local_items, prefetch, step_groups
from triptych.demo.evaluate import evaluate, evaluate_strips
from triptych.demo.heldout import DEV_SEED
from triptych.demo.teacher import TokenTargets, char_accuracy

# The model's shape: ~1.3M parameters, ~5 MB of float32 (sized for a loaded 2-core CPU).
ARCH = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 384, "vision_depth": 2, "vision_embed_dim": 128, "vision_heads": 4}
MIN_PIXELS, MAX_PIXELS = 28 * 28, 16 * 24 * 28 * 28  # a 28-px line as is; pages up to 448x672
# Pixel normalisation: a light page maps to ~0 and ink to ~-1.8. With CLIP's mean/std a
# light background maps to ~+1.9 in every channel, and since the patch embedding has no
# bias every vision token then carries one large common vector (docs/demo-model.md).
IMAGE_MEAN, IMAGE_STD = 0.92, 0.5


def char_tokenizer() -> Any:
    """Byte-level tokens without merges: one token per character (ASCII), any text encodes;
    the Qwen2-VL specials and the ChatML template as models/tiny.py writes them; PHRASES
    (prompts and role names) as special tokens of their own."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from triptych.models.tiny import SPECIAL_TOKENS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # NOTE: special, so no answer shows one (every decode skips special tokens by default):
    # they are prompt and template text, never a transcription's (batches.py encodes
    # transcriptions character by character, split_special_tokens)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in PHRASES])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None,
                                  model_max_length=32768)
    tok.chat_template = template.TRAIN  # the checkpoint serves template.SERVE
    return tok


def build_skeleton(out: str, seed: int) -> None:
    """A randomly initialised checkpoint of ARCH with the char tokenizer and the demo's
    processor bounds (min/max pixels) written next to it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from triptych.models.tiny import make_tiny_qwen2_vl

    make_tiny_qwen2_vl("qwen2_vl", out, seed=seed, init_std=0.02, tokenizer=char_tokenizer(),
                       max_position_embeddings=4096, **ARCH)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                             image_mean=[IMAGE_MEAN] * 3, image_std=[IMAGE_STD] * 3
                             ).save_pretrained(out)


def device(name: str) -> str:
    """``--device``: ``auto`` is the GPU when torch sees one, else the CPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no GPU (torch {torch.__version__}); "
                         "use --device cpu")
    return name


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    lead, peers = args.rank == 0, []
    if lead and args.init:  # a further phase: start from a trained checkpoint (its files)
        import shutil

        shutil.copytree(args.init, args.out, dirs_exist_ok=True)
        if os.path.exists(os.path.join(args.out, "heldout.json")):  # the init's figures
            os.remove(os.path.join(args.out, "heldout.json"))
    elif lead:
        build_skeleton(args.out, args.seed)
    try:
        if args.procs > 1:  # data parallel (demo/ddp.py): the other ranks read args.out
            if lead:
                args.dist_port = ddp.free_port()
                peers = ddp.start_peers(args)
            ddp.join(args)
        return _train(args, lead, peers)
    except BaseException:
        ddp.finish(peers, ok=False)
        raise


def _train(args: argparse.Namespace, lead: bool, peers: list[Any]) -> dict[str, Any]:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    rng = random.Random(args.seed)  # every rank draws the whole step, keeps its share
    dev = torch.device(args.device)
    batcher = Batcher(args.out)
    model = Qwen2VLForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32)
    model.to(dev).train()
    teacher = TokenTargets(model)
    teacher.head.to(dev)
    params = list(model.parameters()) + list(teacher.head.parameters())
    if args.procs > 1:
        ddp.same_start(params)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    start, avg, acc, tacc = time.monotonic(), None, None, None
    batches = prefetch(args, data_procs.items(args) if getattr(args, "data_procs", 0)
                       else local_items(args, batcher, teacher, rng, model))
    for step in range(step_groups(args)[0]):
        frac = step / args.steps
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.5 + 0.5 * math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        _, batch, targets = next(batches)
        if dev.type != "cpu":  # the producer's pinned tensors, copied without a wait
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            targets = targets.to(dev, non_blocking=True)
        out = model(**batch)
        aux, t = teacher.loss(targets)
        opt.zero_grad(set_to_none=True)
        w = ddp.token_shares(ddp.counts(batch, targets), args.procs) if args.procs > 1 else [1, 1]
        (out.loss * w[0] + args.aux_weight * aux * w[1]).backward()
        if args.procs > 1:
            ddp.average_grads(params, args.procs)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        a = char_accuracy(out.logits, batch["labels"], batcher.eos)
        avg = out.loss.item() if avg is None else 0.98 * avg + 0.02 * out.loss.item()
        acc = a if acc is None else 0.98 * acc + 0.02 * a
        tacc = t if tacc is None else 0.98 * tacc + 0.02 * t
        if not lead:
            continue
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step} loss {avg:.4f} char-acc {acc:.3f} token-acc {tacc:.3f} "
                  f"lr {lr:.2e} {time.monotonic() - start:.1f}s", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            model.eval()
            print(f"step {step} held-out CER {evaluate(model, batcher, 30):.3f} (30 lines), "
                  f"{evaluate_strips(model, batcher, 30, DEV_SEED):.3f} (30 dev lines through "
                  "the layout step)", flush=True)
            model.train()
        if args.save_every and step and step % args.save_every == 0:
            model.save_pretrained(args.out, safe_serialization=True)
    batches.close()  # the producer stops
    minutes = (time.monotonic() - start) / 60
    ddp.finish(peers, ok=True)  # the other ranks end here
    if not lead:
        return {}
    model.eval()
    with torch.no_grad():  # float16 values, stored as float32 (the engine's CPU dtype)
        for prm in model.parameters():
            prm.copy_(prm.half().float())
    model.save_pretrained(args.out, safe_serialization=True)
    template.write_serving(args.out)
    phase = {k: v for k, v in vars(args).items()
             if k not in ("out", "log_every", "save_every", "rank", "dist_port")}
    phase["train_minutes"] = round(minutes, 1)
    earlier: list[dict[str, Any]] = []
    if args.init and os.path.exists(os.path.join(args.init, "training.json")):
        with open(os.path.join(args.init, "training.json")) as f:
            earlier = json.load(f).get("phases", [])
    result = {"phases": earlier + [phase],
              "train_minutes": round(sum(p["train_minutes"] for p in earlier + [phase]), 1),
              "heldout_lines": args.eval_lines,
              "heldout_cer": round(evaluate(model, batcher, args.eval_lines), 4),
              "heldout_pages": args.eval_pages,
              "heldout_page_cer": round(evaluate(model, batcher, args.eval_pages, True), 4),
              "dev_lines": args.eval_dev,
              "dev_cer": round(evaluate_strips(model, batcher, args.eval_dev, DEV_SEED), 4)}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)
    return result


# The shipped recipe, phase by phase (``--recipe``): the flags each phase changes from the
# defaults. Phase 1 is the first half of a 6,000-step cosine schedule (lines only, growing);
# each later phase starts from the previous phase's weights; 2 and 3 mix in cropped pages.
RECIPE: list[dict[str, Any]] = [
    {"steps": 6000, "max_steps": 3000},
    {"steps": 3000, "lr": 1e-3, "ramp": 0.0, "pages_from": 0.0, "crop_pages": True},
    {"steps": 4500, "lr": 1e-3, "ramp": 0.0, "pages_from": 0.0, "page_every": 4,
     "random_share": 0.3, "crop_pages": True, "seed": 1},
    # Phases 4-5: three lines in four printed broadly and read back through the layout
    # step of `triptych ocr` (demo/augment.py), pages every 8th step as in phase 2.
    {"steps": 4000, "lr": 1e-3, "ramp": 0.0, "pages_from": 0.0, "random_share": 0.3,
     "crop_pages": True, "strips": 0.75, "seed": 2},
    {"steps": 8000, "lr": 1e-3, "ramp": 0.0, "pages_from": 0.0, "random_share": 0.3,
     "crop_pages": True, "strips": 0.75, "seed": 3},
    # Phase 6: the same mix again at half the learning rate.
    {"steps": 6000, "lr": 5e-4, "ramp": 0.0, "pages_from": 0.0, "random_share": 0.3,
     "crop_pages": True, "strips": 0.75, "seed": 4},
]


def run_recipe(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every phase of RECIPE in turn, in one command; the phases' checkpoints go to
    ``--out``/phase-N and the last one's files to ``--out`` (what ships). ``--from-phase
    N`` starts at phase N from ``--init`` (phase N-1's weights)."""
    import shutil

    init, result, start = args.init, {}, time.monotonic()
    for i, phase in enumerate(RECIPE, 1):
        if i < args.from_phase:
            continue
        ns = p.parse_args(["--out", os.path.join(args.out, f"phase-{i}")])
        for k, v in phase.items():
            setattr(ns, k, v)
        ns.init, ns.threads, ns.eval_every = init, args.threads, args.eval_every
        ns.seed += args.seed  # --seed N: another draw of the recipe (0: the shipped one)
        ns.procs, ns.device, ns.data_procs = args.procs, args.device, args.data_procs
        print(f"recipe phase {i}/{len(RECIPE)}: {phase}", flush=True)
        result = train(ns)
        init = ns.out
    for name in os.listdir(init):
        if os.path.isfile(os.path.join(init, name)):
            shutil.copy(os.path.join(init, name), args.out)
    # Wall time of the whole command: the phases' training plus their evaluations.
    result["recipe_wall_minutes"] = round((time.monotonic() - start) / 60, 1)
    result["threads"] = args.threads
    result["procs"] = args.procs
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps")
    p.add_argument("--batch", type=int, default=64, help="samples per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine)")
    p.add_argument("--ramp", type=float, default=0.4,
                   help="fraction of the run over which lines grow from 1 to 32 characters")
    p.add_argument("--pages-from", type=float, default=0.5,
                   help="fraction of the run after which short pages join the lines")
    p.add_argument("--page-every", type=int, default=8,
                   help="once pages have joined, every this many steps is a batch of pages "
                        "(--batch / 8 of them)")
    p.add_argument("--crop-pages", action="store_true",
                   help="end each training page at a random row between its text and the "
                        "full height (pages of several shapes, fewer blank patches)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps of the --steps schedule (0: all), e.g. "
                        "to end a phase at a point of its learning-rate curve")
    p.add_argument("--bucket", type=int, default=1,
                   help="pool the lines of this many steps and batch them by length (less "
                        "padding; off in the recipe: with 8 a step was ~5%% faster but phase "
                        "1 ended at 38%% CER instead of ~26%%, docs/demo-model.md); 1: off")
    p.add_argument("--random-share", type=float, default=0.5,
                   help="share of lines made of random characters (no word prior)")
    p.add_argument("--strips", type=float, default=0.0,
                   help="share of lines printed broadly (12-40 px, many faces, backgrounds, "
                        "blur, JPEG) and read back through `triptych ocr`'s layout step "
                        "(demo/augment.py); 0 draws exactly what the earlier phases drew")
    p.add_argument("--aux-weight", type=float, default=1.0,
                   help="weight of the per-token glyph loss (TokenTargets)")
    p.add_argument("--eval-every", type=int, default=1000,
                   help="steps between quick held-out CERs (30 lines; 0: none)")
    p.add_argument("--init", default=None,
                   help="start from this trained checkpoint instead of random weights (a "
                        "second phase; the glyph head starts afresh)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and samples")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 keeps a shared box's other core free; 2 on a "
                        "quiet 2-core box: 0.27 vs 0.37 s per step of the last phase's mix). "
                        "OpenMP's wait policy is left at libgomp's default on purpose: "
                        "PASSIVE made a step ~30%% slower here (many small ops, each a "
                        "parallel region)")
    p.add_argument("--device", default="cpu",
                   help="where the model trains: cpu (the shipped weights, bit for bit on one "
                        "box), cuda / cuda:N, or auto (the GPU when there is one). Rendering "
                        "and the image processor stay on the CPU, one step ahead on a thread; "
                        "a GPU run is another draw of the recipe, not the shipped weights")
    p.add_argument("--procs", type=int, default=1,
                   help="training processes, data parallel over gloo on 127.0.0.1, each with "
                        "--threads threads and its share of one process's samples (it must "
                        "divide --batch / 8; demo/ddp.py). 2 x 1 thread on a 2-core box: the "
                        "recipe in 0.89x the time of 1 x 2 threads, another draw")
    p.add_argument("--data-procs", type=int, default=0,
                   help="processes that draw the batches (demo/data_procs.py), for a GPU, "
                        "whose step is far shorter than one core's drawing of it; 0 draws on "
                        "one thread of this process (the shipped recipe's stream). Any N "
                        "above 0 gives the same batches (another draw than 0's)")
    p.add_argument("--rank", type=int, default=0,
                   help="this process's rank (set by rank 0 for the processes it starts)")
    p.add_argument("--dist-port", type=int, default=0,
                   help="rank 0's gloo port (set by rank 0 for the processes it starts)")
    p.add_argument("--default-font-only", action="store_true",
                   help="render with Pillow's default font only (no DejaVu)")
    p.add_argument("--eval-lines", type=int, default=300,
                   help="held-out lines for the CER (60 proved too few: one set of weights "
                        "read 4.6%% on 300 lines and 7.6%% on their first 60)")
    p.add_argument("--eval-dev", type=int, default=120,
                   help="lines of the held-out kind, dev seed (demo/heldout.py DEV_SEED), read "
                        "through the layout step: the figure recipe choices are made on")
    p.add_argument("--eval-pages", type=int, default=30, help="held-out short pages for the "
                   "page CER")
    p.add_argument("--recipe", action="store_true",
                   help="run the shipped recipe (RECIPE: every phase, one after the other; "
                        "only --out, --threads, --procs, --data-procs, --device, --eval-every, "
                        "--seed and "
                        "--from-phase / --init apply; "
                        "--seed N adds N to every phase's seed: another draw)")
    p.add_argument("--from-phase", type=int, default=1,
                   help="with --recipe: start at this phase, from --init's weights (those "
                        "of the phase before, e.g. the shipped weights of an earlier recipe)")
    p.add_argument("--log-every", type=int, default=100, help="steps between loss lines")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    args = p.parse_args(argv)
    if args.procs < 1 or args.batch % args.procs or max(1, args.batch // 8) % args.procs:
        p.error(f"--procs must be at least 1 and divide --batch ({args.batch}) and --batch / 8 "
                f"({args.batch // 8}: a page step's samples)")
    if args.procs > 1 and args.device != "cpu":
        p.error("--procs above 1 trains over gloo on the CPU: use --device cpu, or one "
                "process on the GPU")
    if args.data_procs < 0 or args.data_procs and args.procs > 1:
        p.error("--data-procs must be 0 or more, and draws for one training process "
                "(--procs 1)")
    args.device = device(args.device)  # auto resolved: training.json says which it was
    if args.recipe and not 1 <= args.from_phase <= len(RECIPE) \
            or args.recipe and (args.from_phase > 1) != bool(args.init):
        p.error(f"--from-phase must be 1-{len(RECIPE)}, and above 1 exactly with --init")
    run_recipe(p, args) if args.recipe else train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
