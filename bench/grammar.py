"""Structured-output overhead per decode step: ``python -m triptych.bench.grammar``.

A batch of N text requests (fixed-length outputs, ``ignore_eos``) through the in-process
engine, twice per round: none constrained, then half constrained (JSON schema and regex,
alternating; grammars that cannot complete within the output length, so every request
decodes the same number of steps). Prints per round the wall time per engine step of both
runs and the time the grammar path itself took per step (bitmask fill + one batched
apply), then the medians; plus the cold compile time of each grammar and a cache hit's.
The checkpoint is random (``make_tiny``) with a real-size vocabulary, so the bitmask is as
wide as a Qwen2-VL one; weights are small, so the grammar's share is an upper bound.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

SCHEMA = {"type": "array", "minItems": 500,
          "items": {"type": "string", "minLength": 1, "maxLength": 8}}


def _run(llm, n: int, out_len: int, structured: bool) -> tuple[float, int, float, int]:
    """(wall seconds, engine steps, grammar seconds, masked steps) of one batch."""
    from triptych import SamplingParams
    from triptych.engine.structured.structured_params import StructuredOutputsParams as S

    core = llm.engine.core
    g = core.runner.batch.grammars
    specs = [S(json=SCHEMA), S(regex=f"[a-z]{{{out_len * 8}}}")]
    params = [SamplingParams(max_tokens=out_len, ignore_eos=True, seed=i,
                             structured_outputs=specs[i % 4 // 2]
                             if structured and i % 2 else None) for i in range(n)]
    steps0, gs0, gn0 = core.runner.times.steps, g.mask_seconds, g.num_masked_steps
    t0 = time.perf_counter()
    llm.generate([f"Request {i}:" for i in range(n)], params, use_tqdm=False)
    return (time.perf_counter() - t0, core.runner.times.steps - steps0,
            g.mask_seconds - gs0, g.num_masked_steps - gn0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8000, help="tokenizer vocabulary")
    p.add_argument("--model-vocab", type=int, default=151936, help="logits width")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    from triptych import LLM
    from triptych.engine.structured.structured_params import StructuredOutputsParams as S
    from triptych.models.tiny import make_tiny

    tmp = tempfile.mkdtemp(prefix="grammar-bench-")
    try:
        model = make_tiny("qwen2_vl", f"{tmp}/ckpt", hidden_size=128, num_layers=2,
                          vocab_size=args.vocab, model_vocab_size=args.model_vocab)
        llm = LLM(model, max_num_seqs=args.num_requests, enable_prefix_caching=False,
                  max_model_len=512)
        comp = llm.engine.core.grammars
        compile_s = {}
        for name, spec in (("json_schema", S(json=SCHEMA)),
                           ("regex", S(regex=f"[a-z]{{{args.output_len * 8}}}"))):
            t0 = time.perf_counter()
            comp.compile(spec)
            compile_s[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        comp.compile(S(json=SCHEMA))
        compile_s["cache_hit"] = time.perf_counter() - t0
        _run(llm, 4, 4, True)  # warm-up
        rows = []
        for r in range(args.rounds):
            base = _run(llm, args.num_requests, args.output_len, False)
            half = _run(llm, args.num_requests, args.output_len, True)
            row = {"round": r, "none_ms_per_step": 1e3 * base[0] / base[1],
                   "half_ms_per_step": 1e3 * half[0] / half[1],
                   "grammar_ms_per_masked_step": 1e3 * half[2] / max(half[3], 1),
                   "masked_steps": half[3], "steps": half[1],
                   "none_grammar_calls": base[3]}
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in row.items()}))
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("none_ms_per_step", "half_ms_per_step", "grammar_ms_per_masked_step")}
        summary = {"num_requests": args.num_requests, "output_len": args.output_len,
                   "vocab": args.vocab, "model_vocab": args.model_vocab,
                   "compile_ms": {k: round(1e3 * v, 3) for k, v in compile_s.items()},
                   "median": {k: round(v, 3) for k, v in med.items()}, "rounds": rows}
        print(json.dumps(summary["compile_ms"]), json.dumps(summary["median"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
