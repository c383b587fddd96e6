"""`python -m triptych.bench.cpu_linear`: the decode step's weight GEMMs on this CPU, per
layer shape, weight format (fp32 / bf16 / fp16 / int8), batch rows and thread count.

Runs the bench LM's GEMMs (hidden 512, 8 layers, intermediate 1376, 152k-row tied head;
``models/demo.BENCH_FLAGS``) in decode-step order over 8 layers of distinct weights, so
each weight comes from memory as in a real step (the step's weights outgrow the L3).
Rounds alternate every (format, rows, threads) cell; medians per cell. The ``policy``
column is the thread count ``CpuGemm.threads`` picks (kernels/cpu_linear.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from triptych.kernels.cpu_linear import FORMATS, CpuGemm

# The bench LM's layout; --hidden 1536 --intermediate 8960 --qkv 2048 is Qwen2-VL-2B's.
HIDDEN, INTER, LAYERS, VOCAB, QKV = 512, 1376, 8, 151936, 1024


def shapes(h: int, inter: int, qkv: int) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, bias) of one layer's GEMMs."""
    return [("qkv", h, qkv, True), ("o", h, h, False), ("gate_up", h, 2 * inter, False),
            ("down", inter, h, False)]


def build(fmt: str, gen: torch.Generator, args: argparse.Namespace
          ) -> dict[str, list[CpuGemm]]:
    out: dict[str, list[CpuGemm]] = {}
    for name, k, n, bias in shapes(args.hidden, args.intermediate, args.qkv):
        out[name] = [CpuGemm(torch.randn(n, k, generator=gen) * 0.02,
                             torch.randn(n, generator=gen) * 0.02 if bias else None, fmt)
                     for _ in range(args.layers)]
    out["lm_head"] = [CpuGemm(torch.randn(args.vocab, args.hidden, generator=gen) * 0.02,
                              None, fmt)]
    return out


def step(gemms: dict[str, list[CpuGemm]], x: dict[int, torch.Tensor], threads: int,
         args: argparse.Namespace) -> dict[str, float]:
    """One decode step's GEMMs on ``threads`` threads; seconds per shape (all layers)."""
    took = dict.fromkeys(gemms, 0.0)
    torch.set_num_threads(threads)
    for layer in range(args.layers):
        for name, k, _, _ in shapes(args.hidden, args.intermediate, args.qkv):
            t0 = time.perf_counter()
            gemms[name][layer]._run(x[k])
            took[name] += time.perf_counter() - t0
    t0 = time.perf_counter()
    gemms["lm_head"][0]._run(x[args.hidden])
    took["lm_head"] += time.perf_counter() - t0
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS), help="weight formats to measure")
    p.add_argument("--rows", default="1,8,32", help="batch rows (decode sequences)")
    p.add_argument("--threads", default="1,2", help="thread counts to compare")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; medians reported")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size")
    p.add_argument("--intermediate", type=int, default=INTER, help="MLP intermediate size")
    p.add_argument("--qkv", type=int, default=QKV, help="rows of the fused q|k|v weight")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of distinct weights")
    p.add_argument("--vocab", type=int, default=VOCAB, help="rows of the LM head")
    args = p.parse_args(argv)
    fmts = args.formats.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    gen = torch.Generator().manual_seed(0)
    gemms = {f: build(f, gen, args) for f in fmts}
    cells: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for f in fmts:
            for m in rows:
                x = {k: torch.randn(m, k, generator=gen)
                     for k in (args.hidden, args.intermediate)}
                for t in thread_counts:
                    took = step(gemms[f], x, t, args)
                    if r:
                        cells.setdefault((f, m, t), []).append(took)
    names = [s[0] for s in shapes(args.hidden, args.intermediate, args.qkv)] + ["lm_head"]
    table: list[dict[str, Any]] = []
    most = max(thread_counts)
    for (f, m, t), runs in sorted(cells.items()):
        med = {n: statistics.median(run[n] for run in runs) for n in names}
        row: dict[str, Any] = {"format": f, "rows": m, "threads": t,
                               **{n: med[n] * 1e6 for n in names}}
        row["step_us"] = sum(med.values()) * 1e6
        row["policy"] = {n: gemms[f][n][0].threads(m, most) for n in names}
        table.append(row)
    print(f"median us per shape over {args.layers} layers ({args.rounds} rounds; policy: threads "
          f"CpuGemm picks with {most} available)")
    print(f"{'fmt':9s}{'rows':>5s}{'thr':>4s}" + "".join(f"{n:>10s}" for n in names)
          + f"{'step':>10s}")
    for row in table:
        pol = row["policy"]
        print(f"{row['format']:9s}{row['rows']:5d}{row['threads']:4d}" + "".join(
            f"{row[n]:9.0f}{'*' if pol[n] == row['threads'] else ' '}" for n in names)
            + f"{row['step_us']:10.0f}")
    print("* = the thread count the policy picks for that shape")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"rounds": args.rounds, "shape": {k: getattr(args, k) for k in (
                "hidden", "intermediate", "qkv", "layers", "vocab")}, "table": table}, fh,
                indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
