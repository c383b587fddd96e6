"""`triptych bench floor`: what the device allows one decode step, from its GEMMs alone.

For the served model's shapes (per layer: qkv, o, gate_up, down, or a MoE layer's router
and the experts its rows reach; then the LM head), one decode step's matrix products at
batch 1/8/64/256, timed eager (one launch each, as an engine without graphs runs them) and
captured as one CUDA graph (on the CPU: eager only). ``tok/s floor = batch / step time``:
no engine, whatever its attention, norms or sampling, decodes faster, so engine figures
print as a fraction of it (`triptych bench gpu`, step decode).

    triptych bench floor                          # Qwen2-VL-2B's shapes (no weights needed)
    triptych bench floor --model DIR              # a checkpoint's shapes
    python -m triptych.bench.decode_floor --device cpu --batches 1,8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The served model of issue 32's figures: Qwen2-VL-2B's language model.
QWEN2_VL_2B: dict[str, int] = {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2,
                               "head_dim": 128, "inter": 8960, "vocab": 151936}


@dataclass(frozen=True)
class StepGemms:
    """The language model's sizes that fix a decode step's GEMMs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int  # dense MLP width
    vocab: int  # LM head rows (the embedding's, padded as checkpoints pad it)
    sparse_layers: int = 0  # MoE layers (the rest are dense)
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> StepGemms:
        from transformers import AutoConfig
        from triptych.models.contract import contract_for
        from triptych.models.qwen3_vl import is_sparse_layer

        hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        contract = contract_for(hf)
        text = contract.text_config(hf)
        sparse = sum(is_sparse_layer(text, i) for i in range(text.num_hidden_layers))
        return cls(hidden=text.hidden_size, layers=text.num_hidden_layers,
                   heads=text.num_attention_heads, kv_heads=text.num_key_value_heads,
                   head_dim=contract.head_dim(text), inter=text.intermediate_size,
                   vocab=text.vocab_size, sparse_layers=sparse,
                   experts=getattr(text, "num_experts", 0) or 0,
                   top_k=getattr(text, "num_experts_per_tok", 0) or 0,
                   moe_inter=getattr(text, "moe_intermediate_size", 0) or 0)

    def layer_gemms(self, batch: int, sparse: bool) -> list[tuple[int, int, int, int]]:
        """(count, rows, in, out) of one layer's GEMMs at ``batch`` decode rows. A MoE layer
        runs its router, then each expert that ``batch * top_k`` routed rows reach (as many
        as there are, spread evenly: the floor's best case)."""
        h, d = self.hidden, self.head_dim
        attn = [(1, batch, h, (self.heads + 2 * self.kv_heads) * d), (1, batch, self.heads * d, h)]
        if not sparse:
            return attn + [(1, batch, h, 2 * self.inter), (1, batch, self.inter, h)]
        reached = min(self.experts, batch * self.top_k)
        rows = -(-batch * self.top_k // reached)
        return attn + [(1, batch, h, self.experts), (reached, rows, h, 2 * self.moe_inter),
                       (reached, rows, self.moe_inter, h)]


def _build(g: StepGemms, batch: int, device: Any, dtype: Any) -> tuple[Callable[[], None], int]:
    """The step's GEMMs as one callable over weights made once (random), and the bytes of
    weight it reads. Each layer has its own weights: a step reads every one, as a model's."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    xs: dict[tuple[int, int], Any] = {}
    pairs, nbytes = [], 0
    layers = [True] * g.sparse_layers + [False] * (g.layers - g.sparse_layers)
    head = [(1, batch, g.hidden, g.vocab)]
    for gemms in [g.layer_gemms(batch, sparse) for sparse in layers] + [head]:
        for count, rows, k, n in gemms:
            x = xs.setdefault((rows, k), torch.randn(rows, k, generator=gen, device=device,
                                                     dtype=dtype))
            for _ in range(count):
                w = torch.randn(n, k, generator=gen, device=device, dtype=dtype) * k ** -0.5
                pairs.append((x, w))
                nbytes += w.numel() * w.element_size()

    def step() -> None:
        for x, w in pairs:
            torch.nn.functional.linear(x, w)

    return step, nbytes


def _time(fn: Callable[[], None], reps: int, cuda: bool) -> float:
    """Seconds per call: ``reps`` calls back to back after warm-up, one sync at the end (no
    host sync inside the timed region: the queue stays full, as an engine's step keeps it)."""
    import torch

    for _ in range(2):
        fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _graphed(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured once as a CUDA graph (warmed up on a side stream first, as
    torch.cuda.graph asks, so cuBLAS sets up its workspaces outside the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(g: StepGemms, batches: list[int], device: str, dtype_name: str, reps: int
            ) -> dict[str, Any]:
    """Eager and (CUDA) graph step times of ``g``'s GEMMs at each batch, with tok/s floors."""
    import torch

    dtype = getattr(torch, dtype_name)
    cuda = torch.device(device).type == "cuda"
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": dtype_name,
        "shape": dataclasses.asdict(g), "reps": reps, "rows": [],
        "graphs": "captured" if cuda else "skipped: CUDA graphs need a CUDA device"}
    for b in batches:
        step, nbytes = _build(g, b, device, dtype)
        row: dict[str, Any] = {"batch": b, "weight_gb": nbytes / 1e9}
        row["eager_ms"] = 1e3 * _time(step, reps, cuda)
        if cuda:
            try:
                row["graph_ms"] = 1e3 * _time(_graphed(step), reps, cuda)
            except RuntimeError as e:  # a capture that fails leaves the eager figure standing
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for kind in ("eager", "graph"):
            if f"{kind}_ms" in row:
                row[f"{kind}_tok_s"] = b / row[f"{kind}_ms"] * 1e3
                row[f"{kind}_gb_s"] = nbytes / row[f"{kind}_ms"] / 1e6
        res["rows"].append(row)
        del step
        if cuda:
            torch.cuda.empty_cache()
    return res


def report(res: dict[str, Any]) -> str:
    """The floor table, one row per batch."""
    s = res["shape"]
    moe = (f", {s['sparse_layers']} MoE layers ({s['experts']} experts, top {s['top_k']}, "
           f"width {s['moe_inter']})" if s["sparse_layers"] else "")
    title = (f"decode-step GEMM floor on {res['device']} ({res['dtype']}): {s['layers']} layers, "
             f"hidden {s['hidden']}, heads {s['heads']}/{s['kv_heads']}x{s['head_dim']}, MLP "
             f"{s['inter']}{moe}, LM head {s['vocab']}; graphs {res['graphs']}")
    lines = [title,
             (f"{'batch':>6}{'weights GB':>11}{'eager ms':>10}{'eager tok/s':>13}"
              f"{'graph ms':>10}{'graph tok/s':>13}{'graph GB/s':>12}")]
    for r in res["rows"]:
        g = (f"{r['graph_ms']:>10.3f}{r['graph_tok_s']:>13,.0f}{r['graph_gb_s']:>12,.0f}"
             if "graph_ms" in r else f"{'-':>10}{'-':>13}{'-':>12}")
        lines.append(f"{r['batch']:>6}{r['weight_gb']:>11.2f}{r['eager_ms']:>10.3f}"
                     f"{r['eager_tok_s']:>13,.0f}" + g)
    return "\n".join(lines)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint dir whose shapes to use (default: Qwen2-VL-2B's)")
    p.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu (auto: cuda if present)")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 | float16 | float32 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--reps", type=int, default=20, help="timed steps per figure")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")


def add_parser(sub: Any) -> None:
    _add_args(sub.add_parser("floor", help="the decode step's GEMMs alone: eager and as one "
                                           "CUDA graph, tok/s floors per batch"))


def run(args: argparse.Namespace) -> int:
    import torch

    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    g = StepGemms.from_checkpoint(args.model) if args.model else StepGemms(**QWEN2_VL_2B)
    res = measure(g, [int(b) for b in args.batches.split(",")], device, dtype, args.reps)
    print(report(res))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(ap)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
