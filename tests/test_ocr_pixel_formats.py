"""`triptych ocr` reads a 16-bit greyscale scan as it reads its 8-bit twin (issue 41): the
built-in demo model, through the layout step and the in-process server, answers the same
text for held-out lines saved both ways, and a 16-bit TIFF page (converted to PNG on the
way in) alike. Before, both ``convert("RGB")`` calls clipped 0..65535 to 0..255: every
sample above 0 turned white, the page went blank and the run still exited 0.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from triptych.demo import heldout

TIMEOUT = 300
LINES = 2


def test_sixteen_bit_lines_read_as_their_eight_bit_twins(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    names = []
    for i, sample in enumerate(heldout.lines(LINES)):
        page = np.asarray(sample.image.convert("L"))
        Image.fromarray(page).save(src / f"line-{i}-8.png")
        sixteen = Image.fromarray(page.astype(np.uint16) * 257)
        sixteen.save(src / f"line-{i}-16.png")
        sixteen.save(src / f"line-{i}-16.tif")
        # what the clip did to this page: nearly blank (only pure black survives)
        assert np.asarray(Image.open(src / f"line-{i}-16.png").convert("L")).mean() > \
            np.asarray(Image.open(src / f"line-{i}-8.png")).mean() + 20
        names.append(f"line-{i}")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "triptych", "ocr", "--no-progress", "--format",
                        "jsonl", "--max-tokens", "96", str(src), "-o", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]

    def text(name: str) -> str:
        (row,) = [json.loads(x) for x in (out / "in" / f"{name}.jsonl").read_text().splitlines()]
        assert row["error"] is None, row
        return row["text"]

    for name in names:
        eight = text(f"{name}-8.png")
        assert eight.strip(), name  # the demo model reads the line
        assert text(f"{name}-16.png") == eight and text(f"{name}-16.tif") == eight, name
