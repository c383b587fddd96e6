"""Tensor parallelism on this machine: vision-tower throughput (TP=1, TP=2 "weights", TP=2
"data") and LM decode step time (TP=1 vs TP=2), in one run, fixed seed.

    python bench/tp.py                  # the bench checkpoint (~100M, Qwen2-VL layout)
    python bench/tp.py --tp 4 --reps 5

Rank 0 runs in this process and starts the other ranks, as a worker does; the host's cores
are split between the ranks (worker/threads.py), so TP=N compares N ranks on the cores one
process had. ``tp1_one_rank_share`` is one process on one rank's share of the cores: the
work each rank would do alone if sharding were free. On a 2-core CPU box that is not where TP wins: it halves each rank's threads
and adds a gloo all-reduce per layer. It pays where each rank has its own device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch


def mixed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One 448x448, four 224x224 and three 112x168 images, as patches (14 px, 2 frames)."""
    grid = torch.tensor([[1, 32, 32]] + [[1, 16, 16]] * 4 + [[1, 8, 12]] * 3)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g), grid


def time_encoder(fn: Any, pixels: torch.Tensor, grid: torch.Tensor, reps: int) -> float:
    """Images per second of ``fn(pixels, grid)`` (best of ``reps`` after one warm-up)."""
    with torch.inference_mode():
        fn(pixels, grid)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(pixels, grid)
            best = min(best, time.perf_counter() - t0)
    return len(grid) / best


def encoder_figures(model_dir: str, tp: int, reps: int) -> dict[str, float]:
    from triptych.config import EngineConfig
    from triptych.engine.engine_core import ModelShape
    from triptych.models import load_model
    from triptych.parallel.group import start_group
    from triptych.parallel.runner import TPEncoder

    pixels, grid = mixed_batch(0)
    out: dict[str, float] = {}
    model, hf = load_model(model_dir, torch.float32, "cpu")
    cores = torch.get_num_threads()
    out["tp1"] = time_encoder(model.encode_images, pixels, grid, reps)
    torch.set_num_threads(max(1, cores // tp))  # what one rank of the group gets
    out["tp1_one_rank_share"] = time_encoder(model.encode_images, pixels, grid, reps)
    torch.set_num_threads(cores)
    del model
    shape = ModelShape.from_hf(hf)
    for mode in ("weights", "data"):
        cfg = EngineConfig(model=model_dir, tensor_parallel_size=tp, mm_encoder_tp_mode=mode)
        group = start_group(cfg, hf, "encode", torch.device("cpu"))
        try:
            model, _ = load_model(model_dir, torch.float32, "cpu", tp=group.ctx,
                                  shard_vision=mode == "weights")
            enc = TPEncoder(group, model, shape.hidden_size, torch.float32)
            out[f"tp{tp}_{mode}"] = time_encoder(enc, pixels, grid, reps)
        finally:
            group.close()
            torch.set_num_threads(cores)
    return out


def decode_step_ms(model_dir: str, tp: int, batch: int, steps: int,
                   threads: int | None = None) -> float:
    """Median wall time of a decode step of ``batch`` requests (64-token prompts)."""
    from triptych.config import EngineConfig
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.parallel.loader import load_engine_core

    cores = torch.get_num_threads()
    torch.set_num_threads(threads or cores)
    core = load_engine_core(EngineConfig(model=model_dir, tensor_parallel_size=tp,
                                   kv_cache_memory="512MiB", max_model_len=1024))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        g = torch.Generator().manual_seed(1)
        for i in range(batch):
            core.add_request(f"r{i}", torch.randint(10, 4000, (64,), generator=g).tolist(), sp)
        times = []
        while core.has_unfinished_requests() and len(times) < steps:
            decoding = all(r.num_computed_tokens >= r.num_prompt_tokens
                           for r in core.scheduler.running) and not core.scheduler.waiting
            t0 = time.perf_counter()
            core.step()
            if decoding:
                times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    finally:
        core.close()
        torch.set_num_threads(cores)


def machine() -> str:
    from triptych.engine.device import cpu_features

    return (f"{cpu_features.detect().model}, {os.cpu_count()} cores, {torch.get_num_threads()} "
            f"threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench checkpoint)")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the parallel runs")
    ap.add_argument("--reps", type=int, default=3, help="timed vision-tower calls per setting")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per setting")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every setting, alternating (medians reported)")
    args = ap.parse_args()
    from triptych.models.demo import BENCH_FLAGS, tiny_checkpoint
    from triptych.worker.threads import apply_thread_policy

    apply_thread_policy(None)
    model_dir = args.model or tiny_checkpoint("qwen2_vl", **BENCH_FLAGS)
    print(f"machine: {machine()}\nmodel: {model_dir}", flush=True)
    share = max(1, torch.get_num_threads() // args.tp)
    rounds: dict[str, dict[str, list[float]]] = {"vision_images_per_s": {}, "decode_step_ms": {}}
    for r in range(args.rounds):
        for k, v in encoder_figures(model_dir, args.tp, args.reps).items():
            rounds["vision_images_per_s"].setdefault(k, []).append(v)
        for b in map(int, args.batches.split(",")):
            for name, tp, threads in (("tp1", 1, None), ("tp1_one_rank_share", 1, share),
                                      (f"tp{args.tp}", args.tp, None)):
                rounds["decode_step_ms"].setdefault(f"{name}_batch{b}", []).append(
                    decode_step_ms(model_dir, tp, b, args.steps, threads))
        print(f"round {r + 1}: {json.dumps(rounds)}", flush=True)
    res = {kind: {k: round(statistics.median(v), 2) for k, v in d.items()}
           for kind, d in rounds.items()}
    print(json.dumps({"machine": machine(), "median_of_rounds": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
