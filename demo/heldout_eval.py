"""``python -m triptych.demo.evaluate --heldout``: the demo model on the held-out set
(demo/heldout.py) through the commands a user runs, reported per condition.

    lines, screenshots, multi-page PDFs  -> `triptych ocr --layout lines` (one engine)
    line strips x PROMPTS (free-form prompts, a system turn, text before the image)
                                         -> `triptych run-batch` (one engine)
    10 lines, one request at a time      -> `triptych ocr --max-concurrency 1`: seconds per line

The CER is edit distance over reference characters, summed over a condition's samples; a
screenshot or PDF page is compared as its whole text (lines joined by newlines, so a line
missed, merged or out of order counts), PDF pages in page order.
"""
from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from typing import Any

from triptych.demo import heldout, render

# (family, system turn, user text, text before the image): what newcomers write.
PROMPTS = [
    ("ocr default", None, "Transcribe all the text on this page, in reading order.", False),
    ("image only", None, None, False),
    ("short question", None, "What does this say?", False),
    ("plain request", None, "Transcribe this image.", False),
    ("long instruction", None, ("Please read all of the text in the picture below and type "
                                "it out exactly as printed, keeping the punctuation, digits "
                                "and capital letters."), False),
    ("text first", None, "Text in this image:", True),
    ("system turn", "You are a careful OCR engine. Answer with the text only.", "Go.", False),
    ("unrelated", None, "Describe this picture in detail.", False),
]


def band(size: int) -> str:
    return "14-18 px" if size <= 18 else "19-24 px" if size <= 24 else "25-32 px"


def edit_ops(hyp: str, ref: str) -> list[tuple[str, str]]:
    """The aligned (ref, hyp) character pairs of a minimal edit path, errors only: ("a",
    "b") a substitution, ("a", "") a character missed, ("", "b") one inserted."""
    n, m = len(ref), len(hyp)
    d = [[i + j if i * j == 0 else 0 for j in range(m + 1)] for i in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]))
    ops, i, j = [], n, m
    while i or j:
        if i and j and d[i][j] == d[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]):
            if ref[i - 1] != hyp[j - 1]:
                ops.append((ref[i - 1], hyp[j - 1]))
            i, j = i - 1, j - 1
        elif i and d[i][j] == d[i - 1][j] + 1:
            ops.append((ref[i - 1], ""))
            i -= 1
        else:
            ops.append(("", hyp[j - 1]))
            j -= 1
    return ops


def _run(cmd: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "triptych", *cmd], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"triptych {cmd[0]} failed:\n{r.stderr[-3000:]}")


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f]


def batch_line(cid: str, png: bytes, family: tuple) -> str:
    _, system, text, text_first = family
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}]
    if text is not None:
        parts.insert(len(parts) * (not text_first), {"type": "text", "text": text})
    msgs = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": parts}]
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": msgs, "max_tokens": 96, "temperature": 0}})


def run(model: str | None, n_lines: int, n_shots: int, n_pdfs: int, n_prompt: int,
        layout: str, work: str) -> dict[str, Any]:
    """Write the sets under ``work``, read them, and return every condition's figures."""
    from triptych.jobs.ocr_lines import page_strips

    lines, shots = heldout.lines(n_lines), heldout.screenshots(n_shots)
    pages = heldout.pdf_pages(n_pdfs)
    for sub in ("lines", "shots", "pdfs", "out", "timing", "timing-out"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    for i, s in enumerate(lines):
        s.image.save(os.path.join(work, "lines", f"line-{i:03d}.png"))
    for i, s in enumerate(shots):
        s.image.save(os.path.join(work, "shots", f"shot-{i:03d}.png"))
    heldout.save_pdfs(pages, os.path.join(work, "pdfs"))
    with_model = ["--model", model] if model else []
    ocr = ["ocr", "--no-progress", "--format", "jsonl", "--layout", layout, "--dpi", "72",
           "--max-tokens", "96", *with_model]
    _run([*ocr, *(os.path.join(work, d) for d in ("lines", "shots", "pdfs")),
          "-o", os.path.join(work, "out")])
    got: dict[str, list[str]] = {}
    for d, n in (("lines", "line-{:03d}.png"), ("shots", "shot-{:03d}.png")):
        total = n_lines if d == "lines" else n_shots
        got[d] = [_jsonl(os.path.join(work, "out", d, n.format(i) + ".jsonl"))[0]["text"]
                  for i in range(total)]
    got["pdfs"] = [r["text"] for d in range(n_pdfs)
                   for r in _jsonl(os.path.join(work, "out", "pdfs", f"doc-{d:02d}.pdf.jsonl"))]
    # Prompts: each of the first n_prompt lines' strips under every family.
    with open(os.path.join(work, "batch.jsonl"), "w") as f:
        for i, s in enumerate(lines[:n_prompt]):
            with open(os.path.join(work, "lines", f"line-{i:03d}.png"), "rb") as im:
                strips = page_strips(im.read())
            f.writelines(batch_line(f"{i}/{k}/{j}", png, fam) + "\n"
                         for k, fam in enumerate(PROMPTS)
                         for j, png in enumerate(p for row in strips for p in row))
    _run(["run-batch", "--no-progress", "-i", os.path.join(work, "batch.jsonl"), "-o",
          os.path.join(work, "batch-out.jsonl"), *with_model])
    pieces: dict[tuple[int, int], list[str]] = defaultdict(list)
    for r in _jsonl(os.path.join(work, "batch-out.jsonl")):
        i, k, _ = map(int, r["custom_id"].split("/"))
        text = r["response"]["body"]["choices"][0]["message"]["content"].strip()
        if text:
            pieces[i, k].append(text)
    # Seconds per line, one request at a time (the engine warm after its first line).
    for i in range(11):
        lines[i].image.save(os.path.join(work, "timing", f"t-{i:02d}.png"))
    _run(["ocr", "--no-progress", "--format", "jsonl", "--layout", "lines",
          "--max-concurrency", "1", *with_model, os.path.join(work, "timing"),
          "-o", os.path.join(work, "timing-out")])
    secs = [_jsonl(os.path.join(work, "timing-out", "timing", f"t-{i:02d}.png.jsonl"))[0]
            ["seconds"] for i in range(1, 11)]
    return _figures(lines, shots, pages, got, pieces, secs)


def _figures(lines: list, shots: list, pages: list, got: dict, pieces: dict,
             secs: list[float]) -> dict[str, Any]:
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    ops: Counter = Counter()

    def add(keys: list[str], hyp: str, ref: str) -> None:
        e, n = render.cer(hyp, ref)
        for k in keys:
            t = table[k]
            t[0], t[1], t[2] = t[0] + e, t[1] + n, t[2] + 1
        ops.update(edit_ops(hyp, ref))

    for s, hyp in zip(lines, got["lines"]):
        add(["lines: all", f"lines: size {band(s.size)}", f"lines: font {s.font}",
             f"lines: background {s.background}", f"lines: noise {s.noise}"], hyp, s.text)
    for s, hyp in zip(shots, got["shots"]):
        add(["screenshots: all", f"screenshots: {s.text.count(chr(10)) + 1} lines",
             f"screenshots: background {s.background}"], hyp, s.text)
    for s, hyp in zip(pages, got["pdfs"]):
        add(["PDF pages: all", f"PDF pages: font {s.font}"], hyp, s.text)
    for k, fam in enumerate(PROMPTS):
        for i, s in enumerate(lines[:len({i for i, _ in pieces})]):
            e, n = render.cer(" ".join(pieces[i, k]), s.text)
            t = table[f"prompts: {fam[0]}"]
            t[0], t[1], t[2] = t[0] + e, t[1] + n, t[2] + 1
    figures = {k: {"cer": round(e / max(n, 1), 4), "chars": n, "samples": c}
               for k, (e, n, c) in sorted(table.items())}
    return {"conditions": figures, "seconds_per_line_median": round(statistics.median(secs), 3),
            "seconds_per_line_max": round(max(secs), 3),
            "errors": [[r, h, c] for (r, h), c in ops.most_common(20)]}


def report(result: dict[str, Any]) -> str:
    """The figures as docs/demo-model.md shows them."""
    out = ["| condition | CER | characters | samples |", "|---|---|---|---|"]
    for k, v in result["conditions"].items():
        out.append(f"| {k} | {100 * v['cer']:.1f}% | {v['chars']} | {v['samples']} |")
    out.append(f"\nOne line at a time: {result['seconds_per_line_median']} s median, "
               f"{result['seconds_per_line_max']} s at most (10 lines).")
    errs = ", ".join(f"{r or '∅'!r}->{h or '∅'!r} x{c}" for r, h, c in result["errors"])
    out.append(f"Most frequent errors (reference -> read): {errs}")
    return "\n".join(out)


def main(model: str | None, sizes: tuple[int, int, int, int], layout: str,
         json_out: str | None, work: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        result = run(model, *sizes, layout, work or tmp)
    result["sizes"] = dict(zip(("lines", "screenshots", "pdfs", "prompt_lines"), sizes))
    result["layout"] = layout
    print(report(result))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0
