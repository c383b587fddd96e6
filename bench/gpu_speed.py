"""The figure steps of `bench gpu` (bench/gpu_check.py): model, floor, syncs, decode, ocr, ttft.

They serve the random checkpoint in Qwen2-VL-2B's shape that step ``model`` builds (on
the GPU, bf16: ~15 s; a smoke run uses the tiny Qwen2-VL), in the engine's default dtype
for it (bf16). Each compares with a peer measured in the same run (the GEMM floor, HF
``generate`` on the same device and dtype) and records the issue's target beside it.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from triptych.bench.gpu_steps import chat, greedy, image

# make_tiny flags of Qwen2-VL-2B's shape (../shared/GPU.md); the tokenizer is small, the
# embedding and LM head have the real 151,936 rows
MODEL_2B: dict[str, Any] = {"hidden_size": 1536, "num_layers": 28, "num_heads": 12,
                            "num_kv_heads": 2, "intermediate_size": 8960, "vision_depth": 32,
                            "vision_embed_dim": 1280, "vision_heads": 16, "vocab_size": 4096,
                            "model_vocab_size": 151936}
OCR_PROMPT = "Transcribe the text in this image."
HF_BESIDE = 0.7  # the engine's share of the GPU where HF's copy of the model runs beside it


def served_model(ctx: Any) -> str:
    """The checkpoint step ``model`` built (a clear failure when it did not)."""
    res = ctx.load("model")
    if not res or not res.get("path"):
        raise RuntimeError("step model built no checkpoint (see model.log)")
    return res["path"]


def step_model(ctx: Any) -> None:
    import torch
    from triptych.models.demo import tiny_checkpoint

    t0 = time.perf_counter()
    if ctx.smoke:
        path, flags = tiny_checkpoint("qwen2_vl"), {}
    else:  # random init of 2.2B parameters: seconds on the GPU, minutes on its host
        torch.set_default_device("cuda")
        torch.set_default_dtype(torch.bfloat16)
        try:
            path, flags = tiny_checkpoint("qwen2_vl", **MODEL_2B), MODEL_2B
        finally:
            torch.set_default_dtype(torch.float32)
            torch.set_default_device("cpu")
    ctx.save(ok=True, path=path, flags=flags,
             summary=f"Qwen2-VL-2B-shaped random checkpoint in {time.perf_counter() - t0:.0f} s"
             if flags else "tiny Qwen2-VL (smoke)")


def step_floor(ctx: Any) -> None:
    from triptych.bench.decode_floor import QWEN2_VL_2B, StepGemms, measure, report

    # the shapes alone: Qwen2-VL-2B's stand in on a GPU where step model built nothing
    built = (ctx.load("model") or {}).get("path")
    g = StepGemms.from_checkpoint(served_model(ctx)) if built or ctx.smoke else \
        StepGemms(**QWEN2_VL_2B)
    res = measure(g, [1, 8, 64, 256], ctx.device, "float32" if ctx.smoke else "bfloat16",
                  reps=2 if ctx.smoke else 20)
    print(report(res))
    kind = "graph" if all("graph_ms" in r for r in res["rows"]) else "eager"
    ctx.save(ok=True, **res, summary=f"{kind} floor: " + ", ".join(
        f"batch {r['batch']} {r[f'{kind}_tok_s']:,.0f} tok/s ({r[f'{kind}_ms']:.2f} ms)"
        for r in res["rows"]) + ("" if kind == "eager" else " (eager: " + ", ".join(
            f"{r['eager_ms']:.2f}" for r in res["rows"]) + " ms)"))


def _engine(ctx: Any, model: str, graphs: list[int] | None = None, **knobs: Any) -> Any:
    """The engine a figure step serves: on the GPU as `triptych serve` starts it (decode
    steps as CUDA graphs of ``graphs`` sizes, else eager); on a smoke run started and
    stepped as a CUDA engine, rehearsed on the CPU (bench/gpu_rehearsal.py)."""
    from triptych.llm import LLM

    knobs = {"enable_prefix_caching": False, "disable_log_stats": True, "max_num_seqs": 64,
             **knobs, **ctx.llm_knobs()}
    if ctx.smoke:  # (small limits: the profile step runs them under the interpreter)
        from triptych.bench.gpu_rehearsal import rehearsed_llm

        knobs.update(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
        llm, start = rehearsed_llm(model, graphs, **knobs)
        ctx.save(rehearsal=start)
        return llm
    if graphs:
        knobs.update(enforce_eager=False,
                     compilation_config={"cudagraph_capture_sizes": list(graphs)})
    return LLM(model, device=ctx.device, **knobs)


def _prompts(llm: Any, batch: int, length: int, seed: int) -> list[list[int]]:
    """Random text token ids below the tokenizer's specials (vision tokens excluded)."""
    import numpy as np

    hi = min(len(llm.get_tokenizer()) - 16, 3000)
    return np.random.default_rng(seed).integers(100, hi, (batch, length)).tolist()


def step_syncs(ctx: Any) -> None:
    """Per decode step at batch 8: the host syncs torch reports (sync debug mode "warn",
    each warning's source line) and the profiler's device->host copies, stream syncs,
    scalar reads and kernel launches. Target (issue 32): no sync inside the forward, one
    device->host copy (the sampled ids) per greedy step."""
    import warnings
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile

    llm = _engine(ctx, served_model(ctx))
    # (a smoke run: Triton under the interpreter, ~1000x slower: tiny batches)
    eng = _decoding(llm, _prompts(llm, 4 if ctx.smoke else 8, 12 if ctx.smoke else 64, 0))
    steps = 3 if ctx.smoke else 8
    batch = 4 if ctx.smoke else 8
    res: dict[str, Any] = {"batch": batch, "steps": steps}
    if ctx.device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    eng.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        where = Counter(f"{w.filename}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message))
        res["sync_warnings_per_step"] = sum(where.values()) / steps
        res["sync_sources"] = {k: v / steps for k, v in where.most_common(12)}
    else:
        res["sync_warnings_per_step"] = "skipped: sync debug mode needs CUDA"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
    counts = Counter()
    for e in prof.key_averages():
        counts[e.key] += e.count
    names = {"dtoh_copies": ("Memcpy DtoH",), "htod_copies": ("Memcpy HtoD",),
             "stream_syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                              "cudaEventSynchronize"),
             "cuda_memcpy_calls": ("cudaMemcpyAsync", "cudaMemcpy"),
             "scalar_reads": ("aten::_local_scalar_dense",), "nonzero": ("aten::nonzero",),
             "launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")}
    for field, keys in names.items():
        res[f"{field}_per_step"] = sum(n for k, n in counts.items()
                                       if any(k.startswith(p) for p in keys)) / steps
    llm.close()
    warned = res["sync_warnings_per_step"]
    met = (res["dtoh_copies_per_step"] <= 1 and res["scalar_reads_per_step"] == 0
           and (isinstance(warned, str) or warned <= 1))
    ctx.save(ok=True, met=met, target="0 syncs inside the forward, 1 device->host copy a step",
             **res, summary=f"per decode step at batch {batch}: " + (
                 f"{warned:g} sync warnings, " if not isinstance(warned, str) else "")
             + f"{res['dtoh_copies_per_step']:g} DtoH copies, {res['stream_syncs_per_step']:g} "
             f"stream syncs, {res['scalar_reads_per_step']:g} scalar reads "
             f"(_local_scalar_dense), {res['launches_per_step']:g} launches")


def _decoding(llm: Any, prompts: list[list[int]]) -> Any:
    """The engine with ``prompts`` admitted (ids ``d0``, ``d1``, ...), prefilled and two
    decode steps in (past first-use costs): every step from here decodes all of them."""
    eng = llm.engine
    for i, ids in enumerate(prompts):
        eng.add_request(f"d{i}", ids, greedy(2048))  # (within max_model_len)
    sched = eng.scheduler
    while sched.waiting or any(r.num_output_tokens < 1 for r in sched.running):
        eng.step()
    for _ in range(2):
        eng.step()
    return eng


def step_decode(ctx: Any) -> None:
    """Decode-only tok/s: decode steps of the whole batch timed back to back, as a fraction
    of the GEMM floor of step ``floor`` at the same batch."""
    import torch

    floor = {r["batch"]: r for r in (ctx.load("floor") or {}).get("rows", [])}
    steps = 4 if ctx.smoke else 48
    rows = []
    batches = [1, 4] if ctx.smoke else [1, 64]
    # eager, then the decode steps as CUDA graphs (issue 33; off by default; a smoke run
    # rehearses them: capture's warm-up forwards, replays run eagerly)
    for mode, graphs in (("eager", None), ("graphs", batches)):
        llm = _engine(ctx, served_model(ctx), graphs)
        for batch in batches:
            eng = _decoding(llm, _prompts(llm, batch, 12 if ctx.smoke else 128, batch))
            runner = eng.core.runner
            sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
            sync()
            waited, phases = runner.fetch.wait_seconds, dict(runner.times.totals)
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            sync()
            row = {"mode": mode, "batch": batch, "async": eng.core.async_scheduling,
                   "step_ms": 1e3 * (time.perf_counter() - t0) / steps}
            row["tok_s"] = batch / row["step_ms"] * 1e3
            # the host's time a step: all but the wait for the sampled ids (point 2 of
            # issue 40: below the device's time, the device never waits for the host)
            row["wait_ms"] = 1e3 * (runner.fetch.wait_seconds - waited) / steps
            row["host_ms"] = row["step_ms"] - row["wait_ms"]
            row["phases_ms"] = {k: 1e3 * (v - phases[k]) / steps
                                for k, v in runner.times.totals.items()}
            for kind in ("graph", "eager"):
                if f"{kind}_tok_s" in floor.get(batch, {}):
                    row[f"of_{kind}_floor"] = row["tok_s"] / floor[batch][f"{kind}_tok_s"]
            rows.append(row)
            ctx.save(rows=rows)
            eng.abort_request([f"d{i}" for i in range(batch)])
        llm.close()
    target = {("eager", 1): 150, ("graphs", 1): 400, ("eager", 64): 20_000,
              ("graphs", 64): 20_000}
    ctx.save(ok=True, met=all(r["tok_s"] >= target.get((r["mode"], r["batch"]), 0)
                              for r in rows),
             target="batch 1 >= 400 tok/s with graphs, >= 150 eager; batch 64 >= 20,000 "
                    "(issue 40)",
             summary="; ".join(f"{r['mode']} batch {r['batch']}: {r['tok_s']:,.0f} tok/s "
                               f"({r['step_ms']:.1f} ms a step, host {r['host_ms']:.1f} ms"
                               + "".join(f", {100 * r[f'of_{k}_floor']:.0f}% of the "
                                                     f"{k} floor" for k in ("graph", "eager")
                                                     if f"of_{k}_floor" in r) + ")"
                               for r in rows))


def step_ocr(ctx: Any) -> None:
    """64 requests x one 448 px image x 128 tokens through `bench throughput` (HF on the
    engine's device and dtype, batch 16). Target (issue 32): >= 8x HF."""
    import argparse
    import json

    from triptych.bench import throughput

    p = argparse.ArgumentParser()
    throughput.add_parser(p.add_subparsers(dest="command"))
    work = (["--num-requests", "4", "--image-size", "112", "--output-len", "8",
             "--hf-batch-size", "2", "--cpu-threads", "1"] if ctx.smoke else
            ["--num-requests", "64", "--image-size", "448", "--output-len", "128",
             "--hf-batch-size", "16", "--gpu-memory-utilization", str(HF_BESIDE)])
    out = ctx.out / "ocr_throughput.json"
    args = p.parse_args(["bench", "throughput", "--preset", "ocr", "--model", served_model(ctx),
                         "--rounds", "1", "--json-out", str(out), *work])
    throughput.run_throughput(args)
    res = json.loads(out.read_text())
    med = res["median"]
    ctx.save(ok=True, met=med["ratio"] >= 15, target=">= 15x HF generate (issues 33, 40)",
             device=res.get("device"), dtype=res.get("dtype"),
             triptych_tok_s=med["triptych_tok_s"], hf_tok_s=med["hf_tok_s"], ratio=med["ratio"],
             summary=f"{res['num_requests']} x {res['image_size']} px x {res['output_len']} "
                     f"tokens: {med['triptych_tok_s']:,.0f} tok/s, HF generate (batch "
                     f"{res['hf_batch_size']}) {med['hf_tok_s']:,.0f}: {med['ratio']:.2f}x")


def step_ttft(ctx: Any) -> None:
    """Time to first token of one image chat (the tower, the prefill, one token; the image
    processor excluded on both sides), a fresh image each time. Target (33): <= 30 ms."""
    import torch
    from triptych.bench.throughput import HFPeer

    llm = _engine(ctx, served_model(ctx),
                  **({} if ctx.smoke else {"gpu_memory_utilization": HF_BESIDE}))
    size = 112 if ctx.smoke else 448

    def processed(seed: int) -> Any:
        return llm.processor.process_chat(chat(OCR_PROMPT, image(seed, size, size)))

    hf = HFPeer(served_model(ctx), 1, 1, [processed(0)], llm.engine.device, llm.engine.dtype)
    llm.generate([processed(1)], greedy(1), use_tqdm=False)
    ours, theirs = [], []
    for seed in range(2, 4 if ctx.smoke else 9):
        p = processed(seed)
        t0 = time.perf_counter()
        llm.generate([p], greedy(1), use_tqdm=False)
        ours.append(time.perf_counter() - t0)
        with torch.inference_mode():
            inp = hf.inputs([p])
            t0 = time.perf_counter()
            hf.model.generate(**inp, **{**hf.gen, "max_new_tokens": 1})
            if ctx.device == "cuda":
                torch.cuda.synchronize()
            theirs.append(time.perf_counter() - t0)
    llm.close()
    ms, hf_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(theirs)
    ctx.save(ok=True, met=ms <= 30, target="<= 30 ms (issue 33)", ttft_ms=ms, hf_ttft_ms=hf_ms,
             image_px=size, runs=len(ours), prompt_tokens=len(p.prompt_token_ids),
             summary=f"one {size} px image chat ({len(p.prompt_token_ids)} prompt tokens): "
                     f"{ms:.1f} ms to the first token, HF generate {hf_ms:.1f} ms (medians of "
                     f"{len(ours)})")
