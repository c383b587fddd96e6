"""`triptych bench throughput | serve`.

throughput: the same N image+prompt requests through triptych and through plain HF
transformers `generate` (padded static batches), same checkpoint, dtype and threads, in
one run; prints requests/s, output tokens/s and the ratio.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: offline throughput vs HF, or a serving load")
    sub = p.add_subparsers(dest="bench_command", required=True)
    t = sub.add_parser("throughput", help="offline throughput: triptych vs HF transformers generate",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--model", default=None,
                   help="checkpoint dir (default: a ~hidden 512 / 8 layer / vision depth 4 random "
                        "checkpoint built once with make-tiny)")
    t.add_argument("--num-requests", type=int, default=64, help="requests, one image each")
    t.add_argument("--image-size", type=int, default=224, help="image width = height, pixels")
    t.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    t.add_argument("--hf-batch-size", type=int, default=8, help="HF generate static batch size")
    t.add_argument("--prompt", default="Describe this image in detail.", help="text of each request")
    t.add_argument("--skip-hf", action="store_true", help="run triptych only")
    t.add_argument("--max-num-seqs", type=int, default=64, help="triptych max_num_seqs")
    t.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="triptych max_num_batched_tokens")
    t.add_argument("--seed", type=int, default=0, help="seed of the images")
    t.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    try:
        from triptych import bench_serve
        bench_serve.add_parser(sub)
    except ImportError:
        pass


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from triptych import bench_serve
        return bench_serve.run(args)
    return run_throughput(args)


def _images(n: int, size: int, seed: int) -> list[Any]:
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def run_throughput(args: argparse.Namespace) -> int:
    import torch

    from triptych.llm import LLM
    from triptych.engine.sampling_params import SamplingParams
    from triptych.models.demo import BENCH_FLAGS, tiny_checkpoint

    model = args.model or tiny_checkpoint("qwen2_vl", **BENCH_FLAGS)
    images = _images(args.num_requests, args.image_size, args.seed)
    convs = [[{"role": "user", "content": [{"type": "image", "image": im},
                                           {"type": "text", "text": args.prompt}]}]
             for im in images]
    llm = LLM(model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, disable_log_stats=True)
    processed = [llm.processor.process_chat(c) for c in convs]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up (one request) so neither side pays first-call costs in the timing.
    llm.generate(processed[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    # Timed: generation from the same preprocessed inputs HF gets (image decoding and the
    # HF image processor run once, outside both timings).
    t0 = time.perf_counter()
    outs = llm.generate(processed, sp, use_tqdm=False)
    t_tri = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict[str, Any] = {
        "model": model, "num_requests": args.num_requests, "image_size": args.image_size,
        "output_len": args.output_len, "threads": torch.get_num_threads(),
        "prompt_tokens": len(processed[0].prompt_token_ids),
        "triptych": {"seconds": t_tri, "requests_per_s": args.num_requests / t_tri,
                     "output_tokens_per_s": n_out / t_tri}}
    print(f"triptych: {args.num_requests / t_tri:.2f} req/s, {n_out / t_tri:.1f} output tok/s "
          f"({t_tri:.1f} s)")
    del llm
    if not args.skip_hf:
        t_hf, n_hf = _run_hf(model, processed, args)
        res["hf"] = {"seconds": t_hf, "requests_per_s": args.num_requests / t_hf,
                     "output_tokens_per_s": n_hf / t_hf, "batch_size": args.hf_batch_size}
        res["ratio_output_tokens_per_s"] = (n_out / t_tri) / (n_hf / t_hf)
        print(f"HF generate (batch {args.hf_batch_size}): {args.num_requests / t_hf:.2f} req/s, "
              f"{n_hf / t_hf:.1f} output tok/s ({t_hf:.1f} s)")
        print(f"ratio (triptych / HF, output tok/s): {res['ratio_output_tokens_per_s']:.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _run_hf(model_dir: str, processed: list[Any], args: argparse.Namespace) -> tuple[float, int]:
    """Plain HF generate over padded static batches of the same processed inputs."""
    import torch
    from transformers import AutoTokenizer

    from triptych.models.hf_oracle import hf_inputs, load_hf_model, no_eos

    hf = load_hf_model(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    no_eos(hf)
    gen = dict(max_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        hf.generate(**hf_inputs(processed[:1], pad), **{**gen, "max_new_tokens": 2})
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, len(processed), args.hf_batch_size):
            chunk = processed[i:i + args.hf_batch_size]
            inp = hf_inputs(chunk, pad)
            out = hf.generate(**inp, **gen)
            n_out += (out.shape[1] - inp["input_ids"].shape[1]) * len(chunk)
    return time.perf_counter() - t0, n_out
