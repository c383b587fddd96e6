"""The built-in demo model reads what a newcomer shows it: the held-out lines (demo/heldout.py:
fonts, sizes, backgrounds and text training never used) come back through `triptych ocr`
(its layout step reads them line by line) with a character error rate no worse than the
figure recorded for them (demo/ocr_demo/heldout.json, `python -m triptych.demo.evaluate
--heldout`); screenshots come back with one line of text per printed line; HF transformers'
own model, applying the checkpoint's own chat template to a free-form prompt and a system
turn, reads the strips alike (the oracle); `triptych serve` in an E+P+D layout answers
`run-batch --server` under every prompt family and `ocr --server` with the same text as
in-process; a held-out PDF comes back page by page, in order.

Lean on purpose: one in-process `ocr` run (lines, screenshots and the PDF together), one
server (E+P+D) for both clients. No --model anywhere: the commands pick the shipped
checkpoint by themselves.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triptych.demo import heldout, render
from triptych.demo.heldout_eval import PROMPTS, batch_line
from triptych.jobs.ocr_lines import page_strips
from triptych.models.demo import demo_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import module_server

TIMEOUT = 300
MAX_TOKENS = "96"
LAYOUT = ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1"]
SHOTS = 4


def recorded() -> dict:
    with open(os.path.join(demo_checkpoint(), "heldout.json")) as f:
        return json.load(f)


LINES = recorded()["sizes"]["lines"]  # the very lines the recorded CER was measured on


def set_cer(hyps: list[str], refs: list[str]) -> float:
    errs = [render.cer(h, r) for h, r in zip(hyps, refs, strict=True)]
    return sum(e for e, _ in errs) / sum(n for _, n in errs)


def ocr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triptych", "ocr", "--no-progress", "--format",
                           "jsonl", "--max-tokens", MAX_TOKENS, *args],
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)


def texts(out: Path, names: list[str], stop: bool = True) -> list[list[str]]:
    """Each document's page texts, in page order (``stop``: each ended by the model)."""
    result = []
    for n in names:
        rows = [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()]
        assert [r["page"] for r in rows] == list(range(1, len(rows) + 1))
        assert all(r["error"] is None and (r["finish_reason"] == "stop" or not stop)
                   for r in rows), rows
        result.append([r["text"] for r in rows])
    return result


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[str], list[str], list[str]]:
    """(folder, line document names, line texts, screenshot texts): the held-out lines and
    the first SHOTS held-out screenshots as PNG files."""
    d = tmp_path_factory.mktemp("heldout") / "in"
    d.mkdir()
    names, refs = [], []
    for i, s in enumerate(heldout.lines(LINES)):
        s.image.save(d / f"line-{i:03d}.png")
        names.append(f"in/line-{i:03d}.png")
        refs.append(s.text)
    shots = heldout.screenshots(SHOTS)
    for i, s in enumerate(shots):
        s.image.save(d / f"shot-{i}.png")
    return d, names, refs, [s.text for s in shots]


@pytest.fixture(scope="module")
def pdf(tmp_path_factory) -> tuple[Path, list[str]]:
    """The first held-out PDF (2-3 pages) and its pages' transcriptions."""
    pages = heldout.pdf_pages(1)
    (path,) = heldout.save_pdfs(pages, str(tmp_path_factory.mktemp("pdf")))
    return Path(path), [p.text for p in pages]


@pytest.fixture(scope="module")
def in_process(inputs, pdf, tmp_path_factory) -> tuple[list[str], list[str], list[str]]:
    """One in-process `triptych ocr` run over the folder and the PDF: (line texts,
    screenshot texts, the PDF's page texts)."""
    (folder, names, _, _), (doc, _) = inputs, pdf
    out = tmp_path_factory.mktemp("ocr-out")
    r = ocr(str(folder), str(doc), "-o", str(out), "--dpi", "72")
    assert r.returncode == 0, r.stderr[-3000:]
    (pages,) = texts(out, [doc.name], stop=False)
    shots = [t for (t,) in texts(out, [f"in/shot-{i}.png" for i in range(SHOTS)])]
    return [t for (t,) in texts(out, names)], shots, pages


def test_ocr_in_process_reads_held_out_lines(inputs, in_process) -> None:
    refs, got = inputs[2], in_process[0]
    cer = set_cer(got, refs)
    # heldout.json rounds to 4 decimals; the engine's greedy text equals HF's (below)
    assert cer <= recorded()["conditions"]["lines: all"]["cer"] + 5e-5, cer


def test_screenshots_come_back_line_for_line(inputs, in_process) -> None:
    refs, got = inputs[3], in_process[1]
    assert [g.count("\n") for g in got] == [r.count("\n") for r in refs], got
    print("screenshot CER", set_cer(got, refs), got)


def strips(folder: Path, i: int) -> list[list[bytes]]:
    return page_strips((folder / f"line-{i:03d}.png").read_bytes())


def test_hf_transformers_reads_them_alike_under_its_own_template(inputs, in_process) -> None:
    import io

    import torch
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration
    from triptych.models.hf_oracle import load_hf_processor

    torch.set_num_threads(1)
    model = Qwen2VLForConditionalGeneration.from_pretrained(demo_checkpoint(),
                                                            dtype=torch.float32).eval()
    proc = load_hf_processor(demo_checkpoint())
    msgs = [{"role": "system", "content": "You are a careful OCR engine."},
            {"role": "user", "content": [{"type": "text", "text": "What does this say?"},
                                         {"type": "image"}]}]
    prompt = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for i in (0, 1, 2):
        read = []
        for png in (p for row in strips(inputs[0], i) for p in row):
            enc = proc(text=[prompt], images=[Image.open(io.BytesIO(png)).convert("RGB")],
                       return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=int(MAX_TOKENS), do_sample=False)
            read.append(proc.tokenizer.decode(out[0, enc["input_ids"].shape[1]:],
                                              skip_special_tokens=True).strip())
        assert " ".join(t for t in read if t) == in_process[0][i]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`triptych serve` in an E+P+D layout (one worker per pool)."""
    yield from module_server(None, tmp_path_factory, *LAYOUT)


def test_e_p_d_server_answers_run_batch_alike_under_any_prompt(inputs, in_process,
                                                               server) -> None:
    folder = inputs[0]
    assert "router listening (1e1p1d)" in server.log_path.read_text()
    lines = []
    for i in range(LINES):  # each line under another prompt family, in turn
        pngs = [p for row in strips(folder, i) for p in row]
        lines += [batch_line(f"{i}/{j}", p, PROMPTS[i % len(PROMPTS)])
                  for j, p in enumerate(pngs)]
    r = subprocess.run([sys.executable, "-m", "triptych", "run-batch", "--no-progress", "-i",
                        "-", "-o", "-", "--server", server.base], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    pieces: list[list[str]] = [[] for _ in range(LINES)]
    for x in r.stdout.splitlines():  # (in input order: a line's pieces left to right)
        row = json.loads(x)
        pieces[int(row["custom_id"].split("/")[0])].append(
            row["response"]["body"]["choices"][0]["message"]["content"].strip())
    assert [" ".join(t for t in p if t) for p in pieces] == in_process[0]


def test_e_p_d_server_answers_ocr_alike(inputs, in_process, server, tmp_path: Path) -> None:
    folder, names = inputs[0], inputs[1]
    r = ocr(str(folder), "-o", str(tmp_path), "--server", server.base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [t for (t,) in texts(tmp_path, names)] == in_process[0]


def test_a_held_out_pdf_reads_page_by_page(pdf, in_process) -> None:
    refs, got = pdf[1], in_process[2]
    # Pages in order, numbered (texts() checks), each answered with one line of text per
    # printed line (the layout step's); quality: heldout.json's "PDF pages" figures.
    assert [g.count("\n") for g in got] == [r.count("\n") for r in refs], got
    print("page CER", set_cer(got, refs), got)
