"""`triptych bench peer`: triptych vs llama.cpp on the bench LM, same bytes, same tokens.

Where llama.cpp is built (``--llama-cpp DIR`` or ``LLAMA_CPP_DIR``: a source tree with
``build/bin/llama-batched-bench``, ``convert_hf_to_gguf.py`` and ``gguf-py``; e.g. the one
inside llama-cpp-python's sdist, the ``peer`` extra):

1. The bench checkpoint's language model (hidden 512, 8 layers, 152k tied vocab) is written
   as a text-only Qwen2ForCausalLM checkpoint: the same tensors, byte for byte.
2. llama.cpp's own converter makes GGUF F32 / F16 / Q8_0 of it. The tiny tokenizer is not
   in its list of known pre-tokenizers: it is mapped to ``qwen2`` explicitly (overrides of
   ``get_vocab_base_pre`` and of Qwen2's ``set_vocab``, which would try sentencepiece first;
   the tokens are the tokenizer's own, padded to the model's vocabulary by the converter).
3. Check: every LM tensor read back from the F32 GGUF hashes equal to the safetensors one.
4. Alternating rounds per batch size: ``llama-batched-bench`` (one process per precision)
   and triptych (one process, offline ``LLM``), on the same token ids: batched-bench draws
   its prompts with the C library's ``rand()`` (never seeded: seed 1) after 16 warm-up
   draws; the same draws here give triptych the same prompts. Both: --threads threads,
   OMP_WAIT_POLICY=PASSIVE (ggml runs on OpenMP here; ``--poll 0`` as well), greedy,
   --output-len tokens each (llama.cpp feeds random tokens: the same work per step).

Output tok/s = sequences x output tokens / (prompt + generation time) on both sides;
llama.cpp's generation-only rate (S_TG) is kept in the JSON too. Medians over --rounds.
``--dtype`` / ``--quantization`` pass through to triptych (its 16-bit / int8 rows).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from triptych.bench.load import output_path

PRECISIONS = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}
CONVERT = """
import sys
from conversion.base import TextModel
from conversion.qwen import Qwen2Model
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # the tiny BPE: Qwen2's rules
Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()  # a BPE tokenizer.json, no .model
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""
HASH_GGUF = """
import hashlib, json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
print(json.dumps({t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in r.tensors}))
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("peer", help="triptych vs llama.cpp (GGUF of the same LM "
                                           "tensors, same token ids)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                   help="llama.cpp source tree with build/bin/llama-batched-bench "
                        "(default: $LLAMA_CPP_DIR)")
    p.add_argument("--model", default=None,
                   help="Qwen2-VL checkpoint (default: the bench preset's random one)")
    p.add_argument("--precisions", default="f32,f16,q8_0",
                   help="llama.cpp GGUF types to convert and run (f32, f16, q8_0)")
    p.add_argument("--batch-sizes", default="1,32", help="sequences per run")
    p.add_argument("--prompt-len", type=int, default=100, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per sequence")
    p.add_argument("--threads", type=int, default=2, help="threads on both sides")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians")
    p.add_argument("--dtype", default=None, help="triptych --dtype (default: its own)")
    p.add_argument("--quantization", default=None, help="triptych --quantization")
    p.add_argument("--output-dir", default="bench-results",
                   help="GGUF files, the text-only checkpoint and the results go here")
    p.add_argument("--json-out", default="bench_peer.json", help="results, in --output-dir")


# -- the same tensors on both sides ---------------------------------------------------------
def text_only_checkpoint(src: str, dst: str) -> None:
    """The language model of a Qwen2-VL checkpoint as a Qwen2ForCausalLM one (same bytes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(dst, "model.safetensors")):
        return
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    text = dict(cfg.get("text_config", cfg))
    rope = text.pop("rope_parameters", None) or {}
    text.pop("layer_types", None)
    text.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                rope_theta=rope.get("rope_theta", 10000.0),
                tie_word_embeddings=cfg.get("tie_word_embeddings", True), torch_dtype="float32")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(text, f, indent=1)
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(("visual.",  # noqa: SIM118
                                                                              "model.visual."))}
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)


def _llama_env(llama: str, threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(llama, "gguf-py"), llama])
    return env


def convert(llama: str, ckpt: str, prec: str, out: str, threads: int) -> None:
    if os.path.exists(out):
        return
    subprocess.run([sys.executable, "-c", CONVERT, ckpt, "--outtype", prec, "--outfile",
                    out + ".tmp"], env=_llama_env(llama, threads), check=True,
                   capture_output=True)
    os.rename(out + ".tmp", out)


def same_bytes(llama: str, ckpt: str, gguf_f32: str) -> dict[str, Any]:
    """Every LM tensor of the checkpoint has a byte-equal tensor in the F32 GGUF."""
    from safetensors import safe_open

    out = subprocess.run([sys.executable, "-c", HASH_GGUF, gguf_f32],
                         env=_llama_env(llama, 1), check=True, capture_output=True, text=True)
    gguf = json.loads(out.stdout.strip().splitlines()[-1])
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        ours = {k: hashlib.sha256(f.get_tensor(k).tobytes()).hexdigest() for k in f.keys()}  # noqa: SIM118 (safe_open)
    missing = sorted(set(ours.values()) - set(gguf.values()))
    return {"checkpoint_tensors": len(ours), "gguf_tensors": len(gguf),
            "byte_equal": len(ours) - len(missing), "all_equal": not missing}


# -- the prompts: batched-bench's own draws -------------------------------------------------
def batched_bench_prompts(batch: int, prompt_len: int, n_vocab: int) -> list[list[int]]:
    """The token ids ``llama-batched-bench -npl batch`` prefills (unshared prompts):
    C ``rand()`` from its default seed, 16 warm-up draws first."""
    libc = ctypes.CDLL(None)
    libc.srand(1)
    for _ in range(16):
        libc.rand()
    return [[libc.rand() % n_vocab for _ in range(prompt_len)] for _ in range(batch)]


# -- the runs -------------------------------------------------------------------------------
def run_llama(llama: str, gguf: str, batch: int, args: argparse.Namespace) -> dict[str, float]:
    exe = os.path.join(llama, "build", "bin", "llama-batched-bench")
    ctx = batch * (args.prompt_len + args.output_len) + 64
    out = subprocess.run([exe, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
                          "-npp", str(args.prompt_len), "-ntg", str(args.output_len),
                          "-npl", str(batch), "-t", str(args.threads), "-tb",
                          str(args.threads), "--poll", "0", "--output-format", "jsonl"],
                         env=_llama_env(llama, args.threads), check=True, capture_output=True,
                         text=True)
    row = json.loads([ln for ln in (out.stdout + out.stderr).splitlines()
                      if ln.startswith('{"n_kv_max"')][-1])
    tokens = batch * args.output_len
    return {"tok_s": tokens / (row["t_pp"] + row["t_tg"]), "tg_tok_s": row["speed_tg"],
            "t_pp": row["t_pp"], "t_tg": row["t_tg"]}


CHILD = """
import json, sys, time
from triptych.bench.peer import triptych_child
triptych_child(json.loads(sys.argv[1]))
"""


def triptych_child(cfg: dict[str, Any]) -> None:
    """A triptych process: load once, then one timed generate per line of stdin (a batch
    size), answered with a JSON line."""
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.llm import LLM
    from triptych.worker.threads import apply_thread_policy

    threads = apply_thread_policy(cfg["threads"])
    knobs = {k: cfg[k] for k in ("dtype", "quantization") if cfg.get(k)}
    llm = LLM(cfg["model"], max_num_seqs=max(cfg["batch_sizes"]), enable_prefix_caching=False,
              disable_log_stats=True, cpu_threads=threads, **knobs)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
    prompts = {b: [list(p) for p in batched_bench_prompts(
        b, cfg["prompt_len"], cfg["vocab"])] for b in cfg["batch_sizes"]}
    warm = prompts[min(prompts)][:1]  # one short request: loads and packs what a step needs
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        b = int(line)
        t0 = time.perf_counter()
        outs = llm.generate(prompts[b], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"tok_s": n / dt, "tokens": n}), flush=True)


def run(args: argparse.Namespace) -> int:
    from triptych.models.demo import BENCH_FLAGS, tiny_checkpoint

    llama = args.llama_cpp
    if not llama or not os.path.exists(os.path.join(llama, "build", "bin",
                                                    "llama-batched-bench")):
        raise SystemExit("bench peer needs a built llama.cpp: --llama-cpp DIR (or "
                         "LLAMA_CPP_DIR) with build/bin/llama-batched-bench in it")
    precs = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precs if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"unknown --precisions {bad}: use {', '.join(PRECISIONS)}")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model = args.model or tiny_checkpoint("qwen2_vl", **BENCH_FLAGS)
    work = output_path(args, "peer")
    lm = os.path.join(work, "text-lm-" + os.path.basename(os.path.normpath(model)))
    text_only_checkpoint(model, lm)
    ggufs = {}
    for p in sorted(set(precs) | {"f32"}):
        ggufs[p] = os.path.join(work, f"{os.path.basename(lm)}-{p}.gguf")
        print(f"converting to {PRECISIONS[p]} GGUF: {ggufs[p]}", flush=True)
        convert(llama, lm, p, ggufs[p], args.threads)
    check = same_bytes(llama, lm, ggufs["f32"])
    print(f"LM tensors byte-equal in the F32 GGUF: {check['byte_equal']} of "
          f"{check['checkpoint_tensors']} ({'all' if check['all_equal'] else 'NOT all'})")
    with open(os.path.join(lm, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cfg = {"model": model, "threads": args.threads, "dtype": args.dtype,
           "quantization": args.quantization, "batch_sizes": batches,
           "prompt_len": args.prompt_len, "output_len": args.output_len, "vocab": vocab}
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rounds: list[dict[str, Any]] = []
    try:
        json.loads(child.stdout.readline())  # loaded and warm
        for r in range(args.rounds):
            for b in batches:
                row: dict[str, Any] = {"round": r, "batch": b}
                for p in precs:
                    row[f"llama_{p}"] = run_llama(llama, ggufs[p], b, args)
                child.stdin.write(f"{b}\n")
                child.stdin.flush()
                row["triptych"] = json.loads(child.stdout.readline())
                rounds.append(row)
                print(f"round {r + 1} batch {b}: triptych {row['triptych']['tok_s']:.1f} "
                      + " ".join(f"llama.cpp {PRECISIONS[p]} {row[f'llama_{p}']['tok_s']:.1f}"
                                 for p in precs) + " output tok/s", flush=True)
    finally:
        child.stdin.close()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    table = _table(rounds, batches, precs, args)
    json_out = output_path(args, args.json_out)
    with open(json_out, "w") as f:
        json.dump({"model": model, "text_checkpoint": lm, "ggufs": ggufs, "same_bytes": check,
                   **{k: v for k, v in cfg.items() if k != "model"}, "rounds": args.rounds,
                   "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "medians": table, "runs": rounds}, f, indent=1)
    print(f"wrote {json_out}")
    return 0 if check["all_equal"] else 1


def _table(rounds: list[dict], batches: list[int], precs: list[str],
           args: argparse.Namespace) -> dict[str, dict[str, float]]:
    label = f"triptych {args.dtype or 'fp32'}" + (f" {args.quantization}"
                                                 if args.quantization else "")
    head = f"| | {label} | " + " | ".join(f"llama.cpp {PRECISIONS[p]} GGUF" for p in precs) \
        + " | triptych / llama.cpp |"
    print(head)
    print("|---" * (3 + len(precs)) + "|")
    med: dict[str, dict[str, float]] = {}
    for b in batches:
        rs = [r for r in rounds if r["batch"] == b]
        m = {"triptych": statistics.median(r["triptych"]["tok_s"] for r in rs)}
        for p in precs:
            m[p] = statistics.median(r[f"llama_{p}"]["tok_s"] for r in rs)
        med[str(b)] = m
        ratios = ", ".join(f"**{m['triptych'] / m[p]:.2f}x** ({PRECISIONS[p]})" for p in precs)
        print(f"| {b} sequence{'s' if b > 1 else ''}, output tok/s | {m['triptych']:.0f} | "
              + " | ".join(f"{m[p]:.0f}" for p in precs) + f" | {ratios} |")
    return med
