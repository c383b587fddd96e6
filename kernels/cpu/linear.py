"""CPU linear layers on weights packed once for a library GEMM, each on the threads it pays for.

``pack_linears(model, fmt)`` runs after a model is loaded on the CPU in fp32: every
``nn.Linear`` of the model (fused q|k|v and gate|up included) keeps its weight packed in
the format ``fmt`` (``--dtype`` / ``--quantization`` on the CPU, see
``engine/sizing/model_shape.resolve_cpu_weights``); activations stay fp32 around every GEMM:

  fmt       weight bytes  kernel (a maintained library's, through torch)
  float32   4             oneDNN inner product on a weight reordered to its blocked layout
  bfloat16  2             oneDNN bf16 inner product (x rounded to bf16, fp32 accumulation,
                          bf16 out, widened back to fp32)
  float16   2             fbgemm ``linear_dynamic_fp16``: fp32 x, the fp16 weight widened
                          in the inner loop, fp32 accumulation and out
  int8      1             fbgemm ``linear_dynamic``: weight int8 per output channel
                          (symmetric), x quantized per call to uint8 (per tensor), int32
                          accumulation, fp32 out

Where the platform chose panels for a format (``isa.CpuKernels.batched``, decided per CPU
in engine/device/platform.py: fp32 wherever AVX2 runs; bf16 where oneDNN's bf16 GEMM does not,
i.e. without AVX-512, its weight widened in registers) our panel GEMM
(``kernels/cpu/panel_gemm.py``) replaces the library for calls above the GEMV's rows (its
panels replace the library's packed copy; ``TRIPTYCH_CPU_PANEL_GEMM=0`` keeps the library
where one runs the format). No fp32 copy of a 16- or 8-bit weight is ever made. The LM
head packs its own copy
(``CpuGemm`` in ``compute_logits``); the embedding keeps its fp32 rows for lookups.

Why (docs/performance.md, 2-core AMD EPYC, torch 2.13 CPU wheel):
- torch's CPU ``F.linear`` is MKL sgemm, 2-3x slower than oneDNN on a packed weight on
  this host for the decode step's shapes; a batch-1 decode step is bound by reading the
  weights (411 MB fp32 for the bench LM, 311 MB of it the LM head), so 2- and 1-byte
  weights cut the step by about the ratio of bytes.
- Threads: waking an idle OpenMP thread costs ~100 us under the passive wait policy
  (worker/threads.py), more than a small GEMM's whole run on one core. Each call takes one
  thread per ``min_flops`` of work or per ``min_bytes`` of weight read, whichever asks for
  more, at most the process's threads: a batch-1 GEMV does almost no FLOPs but reading a
  big weight from memory goes faster on every core. With a spinning wait policy (the user
  set OMP_WAIT_POLICY=ACTIVE or GOMP_SPINCOUNT) wake-ups are cheap and the bars are lower.
  NOTE: torch's thread count is process-wide; the switch is safe because a worker runs
  its model from one thread (nothing else in the process issues torch ops meanwhile).

fp32 outputs differ from ``F.linear`` by float rounding only (another summation order);
greedy outputs stay equal to HF in the parity tests. 16-bit and int8 outputs carry the
weight format's error (tolerances in tests/test_cpu_linear.py, quality in
docs/performance.md).
"""
from __future__ import annotations

import logging
import os
import types
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from triptych.kernels.cpu import gemv as cpu_gemv
from triptych.kernels.cpu import isa
from triptych.kernels.cpu import panel_gemm as cpu_panel_gemm

logger = logging.getLogger("triptych.cpu_linear")

FORMATS = ("float32", "bfloat16", "float16", "int8")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
PACK_HINT_ROWS = 32  # oneDNN picks the blocked layout for about this many rows (any M works)
# One more thread per this much work: ~90 us of one core's GEMM, about twice what waking a
# sleeping thread and joining it cost on a quiet host (~30-50 us per call, measured per
# layer shape at 1 / 8 / 32 rows: docs/performance.md, "The thread rule, measured quiet").
# It was 24e6 (and 8 MiB below), set on a host loaded by other jobs, where a second
# thread often waited for a descheduled peer; there, raise them
# (TRIPTYCH_CPU_GEMM_MIN_FLOPS / TRIPTYCH_CPU_GEMM_MIN_BYTES).
MIN_FLOPS_PASSIVE = 8e6
MIN_FLOPS_SPINNING = 2e6
MIN_BYTES_PASSIVE = 2 << 20  # weight bytes one more thread must read to pay its wake-up
MIN_BYTES_SPINNING = 1 << 20
# Calls of at most this many rows go to the GEMV kernel (kernels/cpu/gemv.py) on a
# row-major copy of the weight. End to end (bench LM, CPU time per token): fp32 b1 0.55x,
# b2 0.54x; bf16 b1 0.71x, b2 0.72x; int8 (VNNI) b1 0.81x, b2 0.81x; fp16 b1 1.05x, so
# fp16 stays on fbgemm (already at the memory's rate) and keeps no copy. At 4 rows the
# libraries won for bf16 / int8 (docs/performance.md, "Where the batch-1 step's time goes").
# fp32 on the AVX-512 panels takes them at every row count instead: on a quiet host a
# batch-1 fp32 decode was 1.14-1.19x llama.cpp with the panels and 0.90-0.97x with the GEMV
# (same runs; docs/performance.md, "Issue 22, third round").
# int8 at 2 rows: fbgemm 3.5-3.8 vs the GEMV 3.9-4.4 CPU ms a step, native and AVX2 alike,
# once the VNNI GEMV lost its masked loads (docs/performance.md, "AVX2-only CPUs").
GEMV_MAX_ROWS = {"float32": 2, "bfloat16": 2, "float16": 0, "int8": 1}
# (format, kernel copy) whose panels take the GEMV's rows too
PANELS_AT_ONE_ROW = {("float32", "avx512"), ("float32", "avx512_bf16")}


def available(fmt: str = "float32") -> bool:
    """The packed kernel of ``fmt`` is in this torch build (x86 CPU wheels have them all)."""
    if fmt in ("float32", "bfloat16"):
        return bool(torch.backends.mkldnn.is_available()) and \
            hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and \
            hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return "fbgemm" in torch.backends.quantized.supported_engines


def _spinning(env: Any) -> bool:
    return env.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE" or "GOMP_SPINCOUNT" in env


def min_flops_per_thread(env: Any = None) -> float:
    """Work (FLOPs) below which one more thread costs more than it saves.

    ``TRIPTYCH_CPU_GEMM_MIN_FLOPS`` overrides; else it follows the OpenMP wait policy this
    process started with (threads.py sets PASSIVE unless the user chose theirs)."""
    env = os.environ if env is None else env
    value = env.get("TRIPTYCH_CPU_GEMM_MIN_FLOPS")
    if value:
        return float(value)
    return MIN_FLOPS_SPINNING if _spinning(env) else MIN_FLOPS_PASSIVE


def min_bytes_per_thread(env: Any = None) -> float:
    """Weight bytes below which one more thread reading them costs more than it saves
    (``TRIPTYCH_CPU_GEMM_MIN_BYTES`` overrides; else by the wait policy, as above)."""
    env = os.environ if env is None else env
    value = env.get("TRIPTYCH_CPU_GEMM_MIN_BYTES")
    if value:
        return float(value)
    return MIN_BYTES_SPINNING if _spinning(env) else MIN_BYTES_PASSIVE


def _int8_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """fbgemm's prepacked weight: int8, one symmetric scale per output row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # NOTE: torch 2.13 marks quantized tensor constructors deprecated; fbgemm's
        # prepack still takes one (the prepacked result holds no quantized tensor).
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, bias)


class CpuGemm:
    """y = x @ W^T (+ b) with W packed in ``fmt``; x [..., K] fp32 on the CPU, y fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 fmt: str = "float32", min_flops: float | None = None,
                 min_bytes: float | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"CPU weight format must be one of {FORMATS}, got {fmt!r}")
        if not available(fmt):
            raise ValueError(f"this torch build has no packed CPU kernel for {fmt} weights "
                             "(oneDNN for float32/bfloat16, fbgemm for float16/int8)")
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        w = weight.detach().contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        self.bias: torch.Tensor | None = None
        # Our panel GEMM replaces the library's packed weight (same bytes) where the platform
        # chose it. bf16 stays on oneDNN where that runs: its AVX512-BF16 GEMM ran as fast
        # at batch 32 and faster on prefills (docs/performance.md, "Batch 32")
        kernels = isa.chosen()
        self.panels: torch.Tensor | None = None
        self.panel_bias = b
        self.panel_variant = -1
        if self._takes_panels(fmt, kernels.batched.get(fmt, "")):
            self.panels = cpu_panel_gemm.pack(w.to(getattr(torch, fmt)))
            self.panel_variant = cpu_panel_gemm.variant_id()
            self.packed = None
        elif fmt == "bfloat16" and kernels.batched[fmt] == "panels":
            raise ValueError("bfloat16 weights need oneDNN's bf16 GEMM (AVX-512) or the C++ "
                             "panel GEMM, which did not build here (install g++)")
        elif fmt == "float32":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.float(), PACK_HINT_ROWS)
            self.bias = b
        elif fmt == "bfloat16":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), PACK_HINT_ROWS)
            self.bias = None if b is None else b.bfloat16()
        elif fmt == "float16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(w.float(), b)
        else:
            self.packed = _int8_pack(w, b)
            # Without VNNI, fbgemm's u8 x s8 pair sums saturate int16: 7-bit activations.
            self.reduce_range = not kernels.int8_vnni
        self._gemv_copy(w, b, fmt, kernels.variant)
        self.weight_bytes = self.out_features * self.in_features * BYTES[fmt]
        # the bias rides with the packed weight (fp32 inside fbgemm's prepack)
        self.bias_bytes = 0 if b is None else b.numel() * (
            self.bias.element_size() if self.bias is not None else 4)
        self.min_flops = min_flops_per_thread() if min_flops is None else min_flops
        self.min_bytes = min_bytes_per_thread() if min_bytes is None else min_bytes

    @staticmethod
    def _takes_panels(fmt: str, path: str) -> bool:
        """The panel GEMM serves ``fmt``'s batched calls: the platform chose it and it is
        built; the A/B switch sends fp32 back to oneDNN (bf16 has no library to go back to
        where panels were chosen)."""
        if path != "panels" or fmt not in cpu_panel_gemm.FORMATS or not cpu_panel_gemm.loaded():
            return False
        return fmt == "bfloat16" or not cpu_panel_gemm.switched_off()

    def _gemv_copy(self, w: torch.Tensor, b: torch.Tensor | None, fmt: str,
                   variant: str) -> None:
        """The row-major weight the GEMV kernel reads (decode steps of 1-2 rows). fp32:
        ``w`` itself (the LM head: the tied embedding, no copy; a layer: its dense
        weight stays alive beside the packed one); bf16: a cast copy; int8: the same
        per-row symmetric quantization as fbgemm's pack, with its scales; fp16: none."""
        self.gemv_max_rows = GEMV_MAX_ROWS[fmt] if cpu_gemv.enabled() else 0
        if self.panels is not None and (fmt, variant) in PANELS_AT_ONE_ROW:
            self.gemv_max_rows = 0  # the panels stream as fast at 1-2 rows, with no hsums
        self.gemv_variant = cpu_gemv.variant_id() if self.gemv_max_rows else -1
        self.gemv_w: torch.Tensor | None = None
        self.gemv_scale: torch.Tensor | None = None
        self.gemv_wsum: torch.Tensor | None = None  # int8: row sums (cpu_gemv.row_sums)
        self.gemv_bias = b
        self.gemv_bytes = 0  # what the copy adds to the process (0 when it shares w)
        if not self.gemv_max_rows:
            return
        if fmt == "float32":
            self.gemv_w = w.float().contiguous()
        elif fmt in ("bfloat16", "float16"):
            self.gemv_w = w.to(getattr(torch, fmt)).contiguous()
        else:  # in slices of rows: no fp32 temporaries the size of a 152k-vocab head
            n = w.shape[0]
            self.gemv_w = torch.empty(w.shape, dtype=torch.int8)
            self.gemv_scale = torch.empty(n, dtype=torch.float32)
            for s in range(0, n, 8192):
                wf = w[s:s + 8192].float()
                scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
                self.gemv_w[s:s + 8192] = torch.round(wf / scale[:, None]).clamp(-128, 127)
                self.gemv_scale[s:s + 8192] = scale
            self.gemv_wsum = cpu_gemv.row_sums(self.gemv_w)
        if self.gemv_w.data_ptr() != w.data_ptr():
            self.gemv_bytes = self.gemv_w.numel() * self.gemv_w.element_size()

    def threads(self, rows: int, most: int) -> int:
        """Threads for a GEMM of ``rows`` rows: one per ``min_flops`` of work or per
        ``min_bytes`` of weight to read, whichever is more, 1..most."""
        flops = 2.0 * rows * self.in_features * self.out_features
        want = max(flops // self.min_flops, self.weight_bytes // self.min_bytes)
        return max(1, min(most, int(want)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        most = torch.get_num_threads()
        rows = x.numel() // max(1, self.in_features)
        want = self.threads(rows, most)
        if 0 < rows <= self.gemv_max_rows:
            x2 = x.reshape(rows, self.in_features).contiguous()
            y = cpu_gemv.gemv(x2 if x2.dtype == torch.float32 else x2.float(), self.gemv_w,
                              self.gemv_scale, self.gemv_bias, want, self.gemv_wsum,
                              self.gemv_variant)
            return y.view(*x.shape[:-1], self.out_features)
        if want == most:
            return self._run(x)
        torch.set_num_threads(want)
        try:
            return self._run(x)
        finally:
            torch.set_num_threads(most)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The index of each row's largest output, [rows] int64, as ``self(x).argmax(-1)``,
        without making the output (fp32 panels: the LM head's greedy tokens); None where
        this weight has no panels."""
        if self.panels is None or self.panels.dtype != torch.float32 or x.dtype != torch.float32:
            return None
        rows = x.numel() // max(1, self.in_features)
        x2 = x.reshape(rows, self.in_features).contiguous()
        return cpu_panel_gemm.gemm_argmax(x2, self.panels, self.out_features, self.panel_bias,
                                          self.threads(rows, torch.get_num_threads()),
                                          self.panel_variant)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] fp32 -> [..., N] fp32
        if not x.is_contiguous():
            x = x.contiguous()
        if self.panels is not None:
            y = cpu_panel_gemm.gemm(x.reshape(-1, self.in_features).float(), self.panels,
                                    self.out_features, self.panel_bias, torch.get_num_threads(),
                                    self.panel_variant)
            return y.view(*x.shape[:-1], self.out_features)
        if self.fmt == "float32":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.fmt == "bfloat16":
            return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.packed, self.bias,
                                                      "none", [], "").float()
        if self.fmt == "float16":
            return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return self.cpu_gemm(x)


def eligible(module: nn.Module) -> bool:
    """A plain (or fused) linear layer with an fp32 CPU weight. Row-parallel layers (their
    own forward, an all-reduce after the GEMM) call ``cpu_gemm`` themselves when set."""
    w = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and \
        w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and w.numel() > 0


def pack_linears(model: nn.Module, fmt: str = "float32",
                 skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Pack every eligible linear layer of ``model`` in place in ``fmt``; returns how many.

    The dense weight is released (the packed copy replaces it; ``weight`` becomes an empty
    tensor of the same dtype, so code that reads ``.weight.dtype`` still works and code
    that would multiply by it fails loudly). Layers named in ``skip`` keep their weight
    (the LM head: ``compute_logits`` reads it, possibly tied to the embedding)."""
    if not available(fmt):
        if fmt != "float32":
            raise ValueError(f"this torch build has no packed CPU kernel for {fmt} weights "
                             "(oneDNN for bfloat16, fbgemm for float16/int8): use --dtype "
                             "float32 without --quantization")
        logger.info("oneDNN packed linear is not in this torch build: linear layers use "
                    "torch's F.linear")
        return 0
    min_flops, min_bytes = min_flops_per_thread(), min_bytes_per_thread()
    n = 0
    for name, module in model.named_modules():
        if name.split(".")[-1] in skip or not eligible(module):
            continue
        # A layer with its own forward (row-parallel: all-reduce, then the bias) calls
        # ``linear`` for the bare GEMM and keeps its bias.
        own = type(module).forward is not nn.Linear.forward
        bias = None if own else module.bias
        module.cpu_gemm = CpuGemm(module.weight, bias, fmt, min_flops, min_bytes)
        if not own:
            module.forward = types.MethodType(_packed_forward, module)
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias.new_empty(0), requires_grad=False)
        n += 1
    return n


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T of a layer with its own forward: packed when ``pack_linears`` packed it."""
    gemm = getattr(module, "cpu_gemm", None)
    return F.linear(x, module.weight) if gemm is None else gemm(x)
