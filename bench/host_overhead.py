"""Host time the GPU path spends outside the device (issue 40 rows 4 and 13), on any machine.

    python -m triptych.bench.host_overhead       # CPU is enough (TRITON_INTERPRET=1 is set)

- the Triton wrappers' own host time (their argument checks, workspaces and launch
  arguments; the kernel launches stubbed out): what an eager decode step pays per layer;
- the output processor's time per token of one long request (offline, and streamed with
  logprobs), at 1,000 / 4,000 / 16,000 tokens: flat when nothing is copied per step.

Compare two commits by running it in each (docs/performance.md, "Issue 40").
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")  # (CPU tensors pass the wrappers' checks)


def _us(fn: Callable[[], object], n: int) -> float:
    for _ in range(min(n, 100)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def wrappers(rounds: int = 5) -> dict[str, float]:
    """Median us a call of the decode and rms_norm wrappers, launches stubbed out."""
    import torch
    from triptych.kernels.triton import decode_attention as da
    from triptych.kernels.triton import norm_rope as nr

    class Noop:
        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *a, **k: None

    saved = {(m, n): getattr(m, n) for m, n in ((da, "_decode_split_kernel"),
                                                (da, "_decode_reduce_kernel"),
                                                (nr, "_rms_norm_kernel"))}
    for m, n in saved:
        setattr(m, n, Noop())
    try:
        q = torch.randn(1, 12, 128)
        kc = torch.zeros(64, 16, 2, 128)
        bt = torch.zeros(1, 8, dtype=torch.int32)
        sl = torch.full((1,), 100, dtype=torch.int32)
        x, w = torch.randn(1, 1536), torch.randn(1536)
        cases = {"decode wrapper": lambda: da.paged_decode_attention(
                     q, kc, kc, bt, sl, 0.1, max_seq_len=100),
                 "rms_norm wrapper": lambda: nr.rms_norm(x, w, 1e-6, x)}
        return {k: statistics.median(_us(f, 2000) for _ in range(rounds))
                for k, f in cases.items()}
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)


def output_processor(lengths: tuple[int, ...] = (1000, 4000, 16000)) -> dict[str, float]:
    """us a token of ``OutputProcessor.process`` for one request fed a token at a time (a
    stand-in tokenizer whose decode costs nothing: the bookkeeping is what is timed)."""
    from triptych.engine.outputs import EngineCoreOutput
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.router.output_processor import OutputProcessor

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "x" * len(ids)

    out = {}
    for n in lengths:
        for stream in (False, True):
            op = OutputProcessor(Tok())
            op.add("r", None, [1, 2, 3], SamplingParams(max_tokens=n,
                                                         logprobs=1 if stream else None),
                   stream=stream)
            t0 = time.perf_counter()
            for i in range(n):
                op.process([EngineCoreOutput("r", [5], [{5: -0.1, 6: -2.0}] if stream else None,
                                             "length" if i == n - 1 else None)])
            kind = "streamed with logprobs" if stream else "offline"
            out[f"{n} tokens, {kind}"] = (time.perf_counter() - t0) / n * 1e6
    return out


def main() -> None:
    for name, us in wrappers().items():
        print(f"{name}: {us:.1f} us a call (launch stubbed)")
    for name, us in output_processor().items():
        print(f"output processor, {name}: {us:.1f} us a token")


if __name__ == "__main__":
    main()
