"""The figure of `triptych bench prep` (``--plot``; or ``python -m triptych.bench.prep_plot
REPORT.json OUT.png`` from a saved report): per photo size, image chats per second with
each process's CPU per image stacked beside it, and the text chat's latency under the
images as a multiple of its idle latency."""
from __future__ import annotations

import json
import sys
from typing import Any

PARTS = (("p0_ms", "P0"), ("prep_ms", "preparation"), ("worker_ms", "worker"))


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sizes = list(report["server"])
    fig, axes = plt.subplots(len(sizes), 3, figsize=(16, 3.6 * len(sizes)), squeeze=False)
    for row, size in zip(axes, sizes):
        table = report["server"][size]
        names = list(table)
        x = range(len(names))
        row[0].bar(x, [table[n]["chats_per_s"] for n in names], color="tab:blue")
        row[0].set_title(f"{size}: image chats per second (higher is better)")
        bottom = [0.0] * len(names)
        for key, label in PARTS:
            vals = [table[n][key] for n in names]
            row[1].bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        row[1].set_title(f"{size}: CPU ms per image, by process")
        row[1].legend()
        ratio = [table[n]["text_loaded_s"] / table[n]["text_idle_s"] for n in names]
        row[2].bar(x, ratio, color="tab:red")
        row[2].axhline(3.0, color="black", linestyle="--", linewidth=1, label="3x idle")
        row[2].set_yscale("log")
        row[2].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        row[2].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        row[2].set_title(f"{size}: text chat latency under the images / idle")
        row[2].legend()
        for ax in row:
            ax.set_xticks(list(x), names, rotation=20, fontsize=8)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(report.get("machine", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m triptych.bench.prep_plot REPORT.json OUT.png")
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
    print(f"wrote {sys.argv[2]}")
