"""`triptych bench throughput | serve | multiturn | ocr | cpu-decode | soak | peer | floor | gpu`.

throughput: the same N image+prompt requests through triptych and through plain HF
transformers `generate` (padded static batches), same checkpoint, threads, device and
compute dtype (the engine's: HF follows it onto a GPU and into bf16), in one process, in alternating rounds (HF, triptych, HF, ...; fresh images every round so no
cache carries over); prints each round, the medians and their ratio. ``--profile`` adds
where a triptych step's time goes; ``--busy-host`` runs a spinning process meanwhile.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
from triptych.bench import machine

# Workload presets; explicit flags override them.
PRESETS: dict[str, dict[str, Any]] = {
    # ~106M-parameter layout on random weights with Qwen2-VL's 151,936-token vocabulary
    "default": {"model_flags": "BENCH", "num_requests": 64, "output_len": 64, "image_size": 224,
                "prompt": "Describe this image in detail."},
    # OCR-like batch job on a small model: 32 pages, one image each, 128 tokens out
    "ocr": {"model_flags": "OCR", "num_requests": 32, "output_len": 128, "image_size": 224,
            "prompt": "Transcribe the text in this image."},
}
OCR_FLAGS: dict[str, Any] = {"hidden_size": 256, "num_layers": 4, "num_heads": 4,
                             "num_kv_heads": 2, "vision_depth": 2, "vision_embed_dim": 64,
                             "vision_heads": 2, "vocab_size": 8000, "model_vocab_size": 8000}


# `bench <name>` -> the module holding its add_parser / run (throughput itself is here)
SUBCOMMANDS = {"serve": "serve", "multiturn": "multiturn", "cpu-decode": "cpu_decode",
               "ocr": "ocr", "soak": "soak", "peer": "peer", "floor": "decode_floor",
               "gpu": "gpu_check", "prep": "prep_serve", "attacks": "attacks"}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: offline throughput vs HF, or a serving load")
    sub = p.add_subparsers(dest="bench_command", required=True)
    t = sub.add_parser("throughput", help="offline throughput: triptych vs HF transformers generate",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="workload: default (64 x 224px, 64 tokens out, ~106M model, 152k vocab) "
                        "or ocr (32 x 224px, 128 tokens out, hidden 256 / 4 layers / 8k vocab)")
    t.add_argument("--model", default=None, help="checkpoint dir (default: the preset's random "
                                                 "checkpoint, built once with make-tiny)")
    from triptych.models.contract import contract_names

    t.add_argument("--arch", choices=contract_names(), default="qwen2_vl",
                   help="architecture of the preset's random checkpoint (ignored with --model)")
    t.add_argument("--num-requests", type=int, default=None, help="requests, one image each")
    t.add_argument("--image-size", type=int, default=None, help="image width = height, pixels")
    t.add_argument("--output-len", type=int, default=None, help="output tokens per request (ignore_eos)")
    t.add_argument("--prompt", default=None, help="text of each request")
    t.add_argument("--hf-batch-size", type=int, default=8, help="HF generate static batch size")
    t.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    t.add_argument("--skip-hf", action="store_true", help="run triptych only")
    t.add_argument("--max-num-seqs", type=int, default=64, help="triptych max_num_seqs")
    t.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="triptych max_num_batched_tokens")
    t.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads for both sides (default: the thread policy's choice)")
    t.add_argument("--attention-backend", default=None,
                   help="triptych's attention kernels: torch | cpu | triton; unset: the "
                        "engine's choice, cpu on a CPU where its C++ kernel builds")
    t.add_argument("--profile", action="store_true",
                   help="print where triptych's step time goes and its efficiency")
    t.add_argument("--busy-host", action="store_true",
                   help="run a CPU-spinning process during the rounds (a noisy neighbour)")
    t.add_argument("--seed", type=int, default=0, help="seed of the images")
    t.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    t.add_argument("--dtype", default="auto", help="triptych --dtype; HF runs in the engine's "
                   "compute dtype (on the CPU, bfloat16 / float16 are 16-bit linear weights "
                   "under fp32 activations: HF stays fp32)")
    t.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="triptych's share of the GPU (default: the engine's); leave room for "
                        "HF's copy of the model on the same device")
    t.add_argument("--quantization", default=None, help="triptych --quantization (int8: 8-bit "
                   "linear weights on the CPU; HF stays fp32)")
    for name in SUBCOMMANDS.values():
        importlib.import_module(f"triptych.bench.{name}").add_parser(sub)


def run(args: argparse.Namespace) -> int:
    if args.bench_command in SUBCOMMANDS:
        return importlib.import_module(f"triptych.bench.{SUBCOMMANDS[args.bench_command]}").run(args)
    return run_throughput(args)


def _images(n: int, size: int, seed: int) -> list[Any]:
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    from triptych.models.demo import BENCH_FLAGS, tiny_checkpoint

    w = dict(PRESETS[args.preset])
    for k in ("num_requests", "output_len", "image_size", "prompt"):
        if getattr(args, k) is not None:
            w[k] = getattr(args, k)
    flags = BENCH_FLAGS if w.pop("model_flags") == "BENCH" else OCR_FLAGS
    w["model"] = args.model or tiny_checkpoint(getattr(args, "arch", "qwen2_vl"), **flags)
    return w


def _spinner() -> subprocess.Popen:
    """A single-threaded busy loop: the neighbour that made OpenMP barriers stall."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_throughput(args: argparse.Namespace) -> int:
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.llm import LLM
    from triptych.worker.threads import apply_thread_policy

    threads = apply_thread_policy(args.cpu_threads)
    w = _resolve(args)
    llm = LLM(w["model"], max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, disable_log_stats=True,
              cpu_threads=threads, dtype=args.dtype, quantization=args.quantization,
              attention_backend=args.attention_backend,
              **({"gpu_memory_utilization": args.gpu_memory_utilization}
                 if args.gpu_memory_utilization else {}))

    def inputs(r: int) -> list[Any]:  # fresh images per round: no cache helps either side
        images = _images(w["num_requests"], w["image_size"], args.seed + 1000 * (r + 1))
        return [llm.processor.process_chat([{"role": "user", "content": [
            {"type": "image", "image": im}, {"type": "text", "text": w["prompt"]}]}])
            for im in images]

    sp = SamplingParams(temperature=0.0, max_tokens=w["output_len"], ignore_eos=True)
    warm = inputs(-1)[:1]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    # HF on the engine's device and in its dtype (on the CPU with 16-bit weights the engine
    # computes in fp32, and so does HF)
    hf = None if args.skip_hf else HFPeer(w["model"], args.hf_batch_size, w["output_len"], warm,
                                       llm.engine.device, llm.engine.dtype)
    res: dict[str, Any] = {"preset": args.preset, **w, "threads": threads,
                           "attention_backend": llm.engine.attention_backend,
                           "device": str(llm.engine.device), "dtype": str(llm.engine.dtype),
                           "hf_batch_size": args.hf_batch_size, "busy_host": args.busy_host,
                           "machine": machine(), "rounds": []}
    prof = None
    spinner = _spinner() if args.busy_host else None
    try:
        for r in range(args.rounds):
            processed = inputs(r)
            row: dict[str, Any] = {}
            if hf is not None:
                row["hf_tok_s"] = hf.run(processed)
            if args.profile and r == args.rounds - 1:
                from triptych.bench.profile import StepProfiler
                prof = StepProfiler(llm.engine)
            t0 = time.perf_counter()
            outs = llm.generate(processed, sp, use_tqdm=False)
            row["triptych_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (
                time.perf_counter() - t0)
            if "hf_tok_s" in row:
                row["ratio"] = row["triptych_tok_s"] / row["hf_tok_s"]
            res["rounds"].append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                  flush=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    _report(res)
    if prof is not None:
        prof.close()
        res["profile"] = _profile(llm, prof, inputs(args.rounds), sp)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _report(res: dict[str, Any]) -> None:
    rounds = res["rounds"]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    res["median"] = med
    print(f"{res['preset']} preset, {res['num_requests']} requests x {res['output_len']} tokens,"
          f" {res['threads']} threads{', busy host' if res['busy_host'] else ''}; medians of "
          f"{len(rounds)} rounds:")
    print(f"  triptych: {med['triptych_tok_s']:.1f} output tok/s")
    if "hf_tok_s" in med:
        print(f"  HF generate (batch {res['hf_batch_size']}): {med['hf_tok_s']:.1f} output tok/s")
        print(f"  ratio (triptych / HF): {med['ratio']:.2f}x (per-round ratios: "
              + ", ".join(f"{r['ratio']:.2f}" for r in rounds) + ")")


def _profile(llm: Any, prof: Any, processed: list[Any], sp: Any) -> dict[str, Any]:
    """Print the last round's step breakdown, then split the forward with hooks (one pass)."""
    from triptych.bench.profile import PartTimer, format_summary

    out: dict[str, Any] = {}
    batch = max((b for k, b, _ in prof.steps if k == "decode"), default=None)
    for kind, b in (("decode", batch), ("mixed", None)):
        s = prof.summary(kind, b)
        if s is not None:
            title = f"{kind} steps" + (f" of batch {b}" if b else "")
            print(format_summary(title, s))
            out[kind] = s
    parts = PartTimer(llm.engine.model)
    llm.generate(processed, sp, use_tqdm=False)
    parts.close()
    out["forward_parts"] = {}
    for kind in ("decode", "prefill"):
        fr = out["forward_parts"][kind] = parts.fractions(kind)
        print(f"{kind} forward by part (hooked pass): "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in fr.items()))
    return out


class HFPeer:
    """Plain HF generate over padded static batches of the same processed inputs, on
    ``device`` in ``dtype`` (the engine's)."""

    def __init__(self, model_dir: str, batch_size: int, output_len: int, warm: list[Any],
                 device: Any = "cpu", dtype: Any = None) -> None:
        import torch
        from transformers import AutoTokenizer
        from triptych.models.hf_oracle import load_hf_model, no_eos

        self.model = load_hf_model(model_dir, dtype or torch.float32).to(device)
        self.device = torch.device(device)
        no_eos(self.model)
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.batch_size = batch_size
        self.gen = {"max_new_tokens": output_len, "do_sample": False, "pad_token_id": self.pad}
        with torch.inference_mode():
            self.model.generate(**self.inputs(warm), **{**self.gen, "max_new_tokens": 2})

    def inputs(self, processed: list[Any]) -> dict[str, Any]:
        """The left-padded batch on the model's device; pixels in its dtype."""
        from triptych.models.hf_oracle import hf_inputs

        inp = hf_inputs(processed, self.pad, self.model.config)
        return {k: v.to(self.device, self.model.dtype) if k.startswith("pixel_values")
                else v.to(self.device) for k, v in inp.items()}

    def run(self, processed: list[Any]) -> float:
        """Output tokens per second over all of ``processed``."""
        import torch

        with torch.inference_mode():
            t0 = time.perf_counter()
            n_out = 0
            for i in range(0, len(processed), self.batch_size):
                chunk = processed[i:i + self.batch_size]
                inp = self.inputs(chunk)
                out = self.model.generate(**inp, **self.gen)
                n_out += (out.shape[1] - inp["input_ids"].shape[1]) * len(chunk)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the last step's work counts too
        return n_out / (time.perf_counter() - t0)
