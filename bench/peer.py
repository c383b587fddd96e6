"""`triptych bench peer`: placeholder (filled in below)."""
from __future__ import annotations

from typing import Any


def add_parser(subparsers: Any) -> None:
    subparsers.add_parser("peer", help="triptych vs llama.cpp on the bench LM")


def run(args: Any) -> int:
    raise SystemExit("not yet")
