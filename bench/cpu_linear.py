"""`python -m triptych.bench.cpu_linear`: the decode step's weight GEMMs on this CPU, per
layer shape, weight format (fp32 / bf16 / fp16 / int8), batch rows and thread count.

Runs the bench LM's GEMMs (hidden 512, 8 layers, intermediate 1376, 152k-row tied head;
``models/demo.BENCH_FLAGS``) in decode-step order over 8 layers of distinct weights, so
each weight comes from memory as in a real step (the step's weights outgrow the L3).
Rounds alternate every (format, kernel, rows, threads) cell; medians per cell. The
``policy`` column is the thread count ``CpuGemm.threads`` picks (kernels/cpu/linear.py).
Kernels: ``lib`` (the libraries' packed GEMMs) and ``gemv`` (kernels/cpu/gemv.py, on
rows up to ``--gemv-rows``); ``cpu`` is the process's CPU time of the cell's step (on a
shared box it moves far less than wall time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from triptych.kernels.cpu import gemv as cpu_gemv
from triptych.kernels.cpu.linear import FORMATS, CpuGemm

# The bench LM's layout; --hidden 1536 --intermediate 8960 --qkv 2048 is Qwen2-VL-2B's.
HIDDEN, INTER, LAYERS, VOCAB, QKV = 512, 1376, 8, 151936, 1024


def shapes(h: int, inter: int, qkv: int) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, bias) of one layer's GEMMs."""
    return [("qkv", h, qkv, True), ("o", h, h, False), ("gate_up", h, 2 * inter, False),
            ("down", inter, h, False)]


def gemm(w: torch.Tensor, b: torch.Tensor | None, fmt: str) -> CpuGemm:
    g = CpuGemm(w, b, fmt)
    if g.gemv_w is None and fmt == "float16" and cpu_gemv.enabled():
        # the engine keeps fp16 on fbgemm (GEMV_MAX_ROWS); a copy here shows why
        g.gemv_w, g.gemv_bias = w.half(), b
    return g


def build(fmt: str, gen: torch.Generator, args: argparse.Namespace
          ) -> dict[str, list[CpuGemm]]:
    out: dict[str, list[CpuGemm]] = {}
    for name, k, n, bias in shapes(args.hidden, args.intermediate, args.qkv):
        out[name] = [gemm(torch.randn(n, k, generator=gen) * 0.02,
                          torch.randn(n, generator=gen) * 0.02 if bias else None, fmt)
                     for _ in range(args.layers)]
    out["lm_head"] = [gemm(torch.randn(args.vocab, args.hidden, generator=gen) * 0.02,
                           None, fmt)]
    return out


def run_one(g: CpuGemm, x: torch.Tensor, kernel: str, threads: int) -> torch.Tensor:
    if kernel == "gemv":
        return cpu_gemv.gemv(x, g.gemv_w, g.gemv_scale, g.gemv_bias, threads, g.gemv_wsum)
    return g._run(x)


def step(gemms: dict[str, list[CpuGemm]], x: dict[int, torch.Tensor], threads: int,
         args: argparse.Namespace, kernel: str = "lib") -> dict[str, float]:
    """One decode step's GEMMs on ``threads`` threads; seconds per shape (all layers) and
    the process CPU seconds of the whole step (``cpu``)."""
    took = dict.fromkeys(gemms, 0.0)
    torch.set_num_threads(threads)
    c0 = time.process_time()
    for layer in range(args.layers):
        for name, k, _, _ in shapes(args.hidden, args.intermediate, args.qkv):
            t0 = time.perf_counter()
            run_one(gemms[name][layer], x[k], kernel, threads)
            took[name] += time.perf_counter() - t0
    t0 = time.perf_counter()
    run_one(gemms["lm_head"][0], x[args.hidden], kernel, threads)
    took["lm_head"] += time.perf_counter() - t0
    took["cpu"] = time.process_time() - c0
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS), help="weight formats to measure")
    p.add_argument("--rows", default="1,8,32", help="batch rows (decode sequences)")
    p.add_argument("--threads", default="1,2", help="thread counts to compare")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; medians reported")
    p.add_argument("--kernels", default="lib,gemv", help="lib (packed library GEMMs) and/or "
                   "gemv (kernels/cpu/gemv.py)")
    p.add_argument("--gemv-rows", type=int, default=4, help="largest rows measured with gemv")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size")
    p.add_argument("--intermediate", type=int, default=INTER, help="MLP intermediate size")
    p.add_argument("--qkv", type=int, default=QKV, help="rows of the fused q|k|v weight")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of distinct weights")
    p.add_argument("--vocab", type=int, default=VOCAB, help="rows of the LM head")
    args = p.parse_args(argv)
    from triptych.engine.device.platform import cpu_kernels

    print(f"kernels: {cpu_kernels()}")  # the platform's choice for this CPU (TRIPTYCH_CPU_ISA)
    fmts = args.formats.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    gen = torch.Generator().manual_seed(0)
    gemms = {f: build(f, gen, args) for f in fmts}
    kernels = args.kernels.split(",")
    if "gemv" in kernels and not cpu_gemv.enabled():
        raise SystemExit("the GEMV kernel is off or not built here (TRIPTYCH_CPU_GEMV, g++)")
    cells: dict[tuple[str, str, int, int], list[dict[str, float]]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for f in fmts:
            for m in rows:
                x = {k: torch.randn(m, k, generator=gen)
                     for k in (args.hidden, args.intermediate)}
                for kern in kernels:
                    if kern == "gemv" and m > args.gemv_rows:
                        continue
                    for t in thread_counts:
                        took = step(gemms[f], x, t, args, kern)
                        if r:
                            cells.setdefault((f, kern, m, t), []).append(took)
    names = [s[0] for s in shapes(args.hidden, args.intermediate, args.qkv)] + ["lm_head"]
    table: list[dict[str, Any]] = []
    most = max(thread_counts)
    for (f, kern, m, t), runs in sorted(cells.items()):
        med = {n: statistics.median(run[n] for run in runs) for n in names}
        row: dict[str, Any] = {"format": f, "kernel": kern, "rows": m, "threads": t,
                               **{n: med[n] * 1e6 for n in names}}
        row["step_us"] = sum(med.values()) * 1e6
        row["cpu_us"] = statistics.median(run["cpu"] for run in runs) * 1e6
        row["policy"] = {n: gemms[f][n][0].threads(m, most) for n in names}
        table.append(row)
    print(f"median us per shape over {args.layers} layers ({args.rounds} rounds; policy: threads "
          f"CpuGemm picks with {most} available)")
    print(f"{'fmt':9s}{'kernel':>7s}{'rows':>5s}{'thr':>4s}" + "".join(
        f"{n:>10s}" for n in names) + f"{'step':>10s}{'cpu':>10s}")
    for row in table:
        pol = row["policy"]
        print(f"{row['format']:9s}{row['kernel']:>7s}{row['rows']:5d}{row['threads']:4d}"
              + "".join(f"{row[n]:9.0f}{'*' if pol[n] == row['threads'] else ' '}"
                        for n in names) + f"{row['step_us']:10.0f}{row['cpu_us']:10.0f}")
    print("* = the thread count the policy picks for that shape")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"rounds": args.rounds, "shape": {k: getattr(args, k) for k in (
                "hidden", "intermediate", "qkv", "layers", "vocab")}, "table": table}, fh,
                indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
