"""The progress bar both jobs show on stderr: items done, their rate, ETA, output tokens/s."""
from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


class Progress:
    """A tqdm bar on stderr (stdout may carry results) with output tokens/s as postfix."""

    def __init__(self, total: int | None, unit: str, desc: str, initial: int = 0,
                 disable: bool = False) -> None:
        self.bar = tqdm(total=total, unit=unit, desc=desc, initial=initial, file=sys.stderr,
                        dynamic_ncols=True, disable=disable)
        self.tokens = 0

    def add_total(self, n: int) -> None:
        """Grow the total (a PDF's page count is known only once it is opened)."""
        self.bar.total = (self.bar.total or 0) + n
        self.bar.refresh()

    def done(self, n: int = 1, tokens: int = 0) -> None:
        self.tokens += tokens
        self.bar.update(n)
        elapsed = self.bar.format_dict.get("elapsed") or 0.0
        if elapsed > 0:
            self.bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s", refresh=False)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Progress"]
