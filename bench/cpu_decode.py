"""`triptych bench cpu-decode`: text decode speed and quality per CPU weight format.

The bench LM (hidden 512, 8 layers, 152k tied vocab; ``models/demo.BENCH_FLAGS``) on
identical token-id prompts (``--prompt-len`` random ids, ``--output-len`` greedy tokens,
ignore_eos), one in-process engine per format, formats alternating in every round:

  output tok/s   batch x output_len / the whole generate call (prefill included)
  decode tok/s   batch x (output_len - 1) / (that call - a 1-token call: the prefill)
  CPU ms/token   process CPU time of the whole call / its output tokens (a shared box's
                 load disturbs it far less than wall time)
  bandwidth      batch 1: bytes a decode step reads (weights + the KV of the mean context)
                 / the decode step, beside the box's read bandwidth measured each round
                 (torch.sum over 1 GiB on the same threads)

``--quality N``: N prompts decoded greedily by fp32 and by each format: how many of the
formats' output tokens match fp32's before the first difference, and, teacher-forced on
fp32's tokens (prompt_logprobs), the log-prob error of those tokens and how often the
format's top-1 is fp32's token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np
from triptych.bench import machine

# name -> engine knobs (kernels/cpu/linear.py packs the weights)
FORMATS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"}, "int8": {"quantization": "int8"}}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
# format suffix -> the kernel switches (env, read at packing) it turns off, for A/B runs
SWITCHES = ("TRIPTYCH_CPU_GEMV", "TRIPTYCH_CPU_PANEL_GEMM", "TRIPTYCH_CPU_FUSED_OPS")
SUFFIXES = {"": (), "lib": SWITCHES, "nopanel": ("TRIPTYCH_CPU_PANEL_GEMM",),
            "nofused": ("TRIPTYCH_CPU_FUSED_OPS",)}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cpu-decode", help="text decode tok/s and quality per CPU "
                              "weight format (fp32 / bf16 / fp16 / int8)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bench LM)")
    p.add_argument("--formats", default="fp32,bf16,fp16,int8",
                   help="weight formats: fp32 | bf16 | fp16 (--dtype) | int8 (--quantization); "
                        "a ':lib' suffix (e.g. fp32:lib) builds that engine with "
                        "TRIPTYCH_CPU_GEMV=0, TRIPTYCH_CPU_PANEL_GEMM=0 and "
                        "TRIPTYCH_CPU_FUSED_OPS=0 (library kernels and torch ops only), "
                        "':nopanel' / ':nofused' with only the panel GEMM / the fused "
                        "layer ops off (A/B runs)")
    p.add_argument("--batch", default="1,32", help="concurrent sequences, comma-separated")
    p.add_argument("--prompt-len", type=int, default=100, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=128, help="greedy output tokens")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads (default: the thread policy's choice)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache of each engine")
    p.add_argument("--quality", type=int, default=0,
                   help="prompts for the quality comparison against fp32 (0: skip)")
    p.add_argument("--profile", action="store_true",
                   help="after the rounds, split one generate call per format and batch: "
                        "engine phases (bench/profile.py) and the top ops (torch.profiler)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    p.add_argument("--dump-prompts", default=None,
                   help="write the prompt token ids ({batch: [[ids]]}) to this JSON file, "
                        "for a peer engine to run the same prompts")


def read_bandwidth(gib: float = 1.0) -> float:
    """GB/s of one pass of torch.sum over ``gib`` GiB of fp32 (median of 3)."""
    import torch

    a = torch.ones(int(gib * (1 << 30)) // 4)
    a.sum()
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        took.append(time.perf_counter() - t0)
    return a.numel() * 4 / statistics.median(took) / 1e9


def step_bytes(hf: Any, fmt: str, context: float) -> float:
    """Bytes one batch-1 decode step reads: every linear weight, the head, the KV."""
    t = getattr(hf, "text_config", hf)
    h, inter, layers = t.hidden_size, t.intermediate_size, t.num_hidden_layers
    head_dim = h // t.num_attention_heads
    kv = t.num_key_value_heads * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter
    weights = (layers * per_layer + t.vocab_size * h) * WEIGHT_BYTES[fmt]
    return weights + layers * 2 * kv * 4 * context  # the KV cache stays fp32


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.llm import LLM
    from triptych.models.demo import BENCH_FLAGS, tiny_checkpoint
    from triptych.worker.threads import apply_thread_policy

    threads = apply_thread_policy(args.cpu_threads)
    model = args.model or tiny_checkpoint("qwen2_vl", **BENCH_FLAGS)
    hf = AutoConfig.from_pretrained(model, local_files_only=True)
    fmts = args.formats.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    vocab = getattr(hf, "text_config", hf).vocab_size
    rng = np.random.default_rng(args.seed)
    llms = {}
    for f in fmts:
        base, _, lib = f.partition(":")
        if base not in FORMATS or lib not in SUFFIXES:
            raise SystemExit(f"unknown format {f!r}: use {', '.join(FORMATS)} "
                             f"(+ {', '.join(':' + k for k in SUFFIXES if k)})")
        # the switches are read when a layer (and, on the first logits, the head) is packed
        saved = {k: os.environ.get(k) for k in SWITCHES}
        for k in SWITCHES:
            os.environ[k] = "0" if k in SUFFIXES[lib] else (saved[k] or "1")
        try:
            llms[f] = LLM(model, max_num_seqs=max(batches + [args.quality]),
                          cpu_threads=threads, enable_prefix_caching=False,
                          disable_log_stats=True, kv_cache_memory=args.kv_cache_memory,
                          **FORMATS[base])
            # warm-up: packs the head, touches every kernel
            llms[f].generate([[1] * 8], SamplingParams(temperature=0.0, max_tokens=2),
                             use_tqdm=False)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    res: dict[str, Any] = {"model": model, "threads": threads, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "rounds": [], "machine": machine()}
    # the same prompts every round (no prefix caching: nothing carries over)
    prompts_of = {b: rng.integers(100, vocab, (b, args.prompt_len)).tolist() for b in batches}
    if args.dump_prompts:
        with open(args.dump_prompts, "w") as fh:
            json.dump({str(b): p for b, p in prompts_of.items()}, fh)
    for r in range(args.rounds):
        row: dict[str, Any] = {"read_gb_s": read_bandwidth()}
        order = fmts[r % len(fmts):] + fmts[:r % len(fmts)]
        for b in batches:
            prompts = prompts_of[b]
            for f in order:
                t0 = time.perf_counter()
                llms[f].generate(prompts, first, use_tqdm=False)
                t1, c1 = time.perf_counter(), time.process_time()
                llms[f].generate(prompts, sp, use_tqdm=False)
                t2, c2 = time.perf_counter(), time.process_time()
                row[f"{f}_b{b}_out_tok_s"] = b * args.output_len / (t2 - t1)
                # CPU time (all threads) per output token: what load on a shared box
                # disturbs least (idle threads sleep under the passive wait policy)
                row[f"{f}_b{b}_cpu_ms_per_tok"] = 1e3 * (c2 - c1) / (b * args.output_len)
                row[f"{f}_b{b}_decode_tok_s"] = b * (args.output_len - 1) / (
                    (t2 - t1) - (t1 - t0))
        res["rounds"].append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    med = {k: statistics.median(rw[k] for rw in res["rounds"]) for k in res["rounds"][0]}
    res["median"] = med
    _report(res, hf, fmts, batches, args)
    if args.profile:
        res["profile"] = {f: {b: split(llms[f], prompts_of[b], sp, f"{f} batch {b}")
                              for b in batches} for f in fmts}
    if args.quality:
        res["quality"] = quality(llms, fmts, args, vocab)
    for llm in llms.values():
        llm.close()
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


def _report(res: dict[str, Any], hf: Any, fmts: list[str], batches: list[int],
            args: argparse.Namespace) -> None:
    med = res["median"]
    print(f"medians of {args.rounds} rounds, {res['threads']} threads, {args.prompt_len}-token "
          f"prompts, {args.output_len} output tokens; read bandwidth {med['read_gb_s']:.1f} GB/s")
    context = args.prompt_len + args.output_len / 2
    for f in fmts:
        line = f"  {f}: " + ", ".join(
            f"batch {b} {med[f'{f}_b{b}_out_tok_s']:.1f} out tok/s "
            f"({med[f'{f}_b{b}_decode_tok_s']:.1f} decode, "
            f"{med[f'{f}_b{b}_cpu_ms_per_tok']:.1f} CPU ms/token)" for b in batches)
        if 1 in batches:
            gb = step_bytes(hf, f.partition(":")[0], context) / 1e9
            bw = gb * med[f"{f}_b1_decode_tok_s"]
            med[f"{f}_b1_step_gb"], med[f"{f}_b1_gb_s"] = gb, bw
            line += (f"; batch-1 step reads {gb * 1e3:.0f} MB: {bw:.1f} GB/s = "
                     f"{100 * bw / med['read_gb_s']:.0f}% of the measured read bandwidth")
        print(line)


def split(llm: Any, prompts: list[list[int]], sp: Any, title: str, top: int = 10
          ) -> dict[str, Any]:
    """Where a decode step's time goes: mean ms per engine phase over one call's decode
    steps, then the ops with the most self CPU time per step over a second call."""
    from torch.profiler import ProfilerActivity, profile
    from triptych.bench.profile import StepProfiler, format_summary

    prof = StepProfiler(llm.engine)
    try:
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        prof.close()
    s = prof.summary("decode", len(prompts))
    print(format_summary(f"{title}: decode", s))
    with profile(activities=[ProfilerActivity.CPU]) as p:
        llm.generate(prompts, sp, use_tqdm=False)
    steps = sp.max_tokens + 1  # decode steps + the prefill
    ops = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
    rows = {e.key: {"self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                    "calls_per_step": e.count / steps} for e in ops[:top]}
    print(f"    ops, self CPU ms per step (all ops: {total:.2f}):")
    for name, r in rows.items():
        print(f"      {name:<44s}{r['self_cpu_ms_per_step']:8.3f}{r['calls_per_step']:8.1f} calls")
    return {"phases": s, "ops_ms_per_step": total, "top_ops": rows}


def quality(llms: dict[str, Any], fmts: list[str], args: argparse.Namespace, vocab: int
            ) -> dict[str, Any]:
    """Greedy agreement and teacher-forced log-prob error of each format against fp32."""
    from triptych.engine.sample.sampling_params import SamplingParams

    if "fp32" not in llms:
        raise SystemExit("--quality compares against fp32: keep fp32 in --formats")
    rng = np.random.default_rng(args.seed + 1)
    prompts = rng.integers(100, vocab, (args.quality, args.prompt_len)).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llms["fp32"].generate(prompts, sp, use_tqdm=False)]
    forced = [p + list(t) for p, t in zip(prompts, ref)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def scored(f: str) -> list[list[Any]]:
        outs = llms[f].generate(forced, score, use_tqdm=False)
        return [[o.prompt_logprobs[i][t] for i, t in enumerate(seq) if i >= args.prompt_len]
                for o, seq in zip(outs, forced)]

    base = scored("fp32")
    out: dict[str, Any] = {}
    for f in fmts:
        if f == "fp32":
            continue
        got = [o.outputs[0].token_ids for o in llms[f].generate(prompts, sp, use_tqdm=False)]
        prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                  for g, r in zip(got, ref)]
        lp = scored(f)
        err = [abs(a.logprob - b.logprob) for sa, sb in zip(lp, base) for a, b in zip(sa, sb)]
        top1 = [a.rank == 1 for sa in lp for a in sa]
        out[f] = {"identical_sequences": sum(p == args.output_len for p in prefix) / len(prefix),
                  "mean_matching_prefix": statistics.mean(prefix) / args.output_len,
                  "logprob_abs_err_mean": statistics.mean(err),
                  "logprob_abs_err_max": max(err), "top1_agreement": statistics.mean(top1)}
        q = out[f]
        print(f"  quality {f} vs fp32 ({args.quality} prompts x {args.output_len} tokens): "
              f"{100 * q['identical_sequences']:.0f}% identical sequences, mean matching prefix "
              f"{100 * q['mean_matching_prefix']:.0f}%, teacher-forced top-1 agreement "
              f"{100 * q['top1_agreement']:.1f}%, |logprob error| mean "
              f"{q['logprob_abs_err_mean']:.4f} max {q['logprob_abs_err_max']:.3f}")
    return out
