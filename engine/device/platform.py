"""What a device uses, decided in one place.

    device   attention kernels       linear layers            sampler's argmax   host policies
                                                              and random draws
    cpu      cpu (C++ decode + fused  packed (oneDNN / fbgemm,  C++ (panel_gemm)   threads +
             ops) or torch           GEMV, panel GEMM)                            allocator
    cuda     triton (or torch)       F.linear in the model's  torch, on device   none
                                     dtype

Everything CPU-specific (kernels/cpu/ and its C++ builds, worker/threads.py and
worker/allocator.py) is reached only through the CPU's choices here: a CUDA engine never
imports, builds or runs it. The step's host/device traffic is engine/device/device_io.py (on the
CPU it copies nothing).

On the CPU, what the processor offers (engine/device/cpu_features.py, the only reader of CPU
flags; ``TRIPTYCH_CPU_ISA=avx2`` makes an AVX-512 box choose as an AVX2-only one) decides,
once per process and logged, which instruction-set copy of the C++ kernels runs and each
weight format's batched path (``cpu_kernels``):

    weights    AVX512-BF16 / AMX CPU      AVX-512 (no BF16)     AVX2 + FMA           older
    float32    panel GEMM (avx512)        panel GEMM (avx512)   panel GEMM (avx2)    oneDNN
    bfloat16   GEMV + oneDNN bf16         GEMV + oneDNN bf16    GEMV + panel GEMM,   the same,
                                                                bf16 widened in      portable
                                                                registers            C++
    float16    fbgemm (fp16 widened in its inner loop), every CPU
    int8       GEMV (VNNI) + fbgemm       GEMV + fbgemm (7-bit activations without VNNI)

A format no kernel here runs well (bf16 with neither oneDNN's bf16 GEMM nor our C++
kernels) is refused at start in one line naming the flag and the formats that run.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from triptych.config import EngineConfig
from triptych.engine.device import cpu_features
from triptych.engine.sample.sampler import Argmax, Draw, torch_argmax

if TYPE_CHECKING:
    from triptych.kernels.cpu.isa import CpuKernels

logger = logging.getLogger("triptych.platform")


@dataclass(frozen=True)
class Platform:
    """One engine process's device choices (``platform_for``)."""

    device: torch.device
    dtype: torch.dtype  # what the model computes in
    attention_backend: str  # torch | cpu | triton (kernels.get_ops)
    cpu_weights: str | None  # the packed format of the CPU linear layers, None: F.linear

    @property
    def host(self) -> bool:
        """The device is the host (no copies between them)."""
        return self.device.type == "cpu"

    def sampler_argmax(self) -> Argmax:
        return sampler_argmax(self.device)


def platform_for(config: EngineConfig, device: torch.device, checkpoint_dtype: Any = None
                 ) -> Platform:
    """The choices for ``device`` under ``config``: kernels, weight format, dtype."""
    from triptych.kernels import resolve_backend

    cpu_weights = resolve_cpu_weights(config, device)
    # A model whose CPU linear layers pack their weights computes in fp32.
    dtype = torch.float32 if cpu_weights else \
        resolve_dtype(config.dtype, device, checkpoint_dtype)
    return Platform(device, dtype, resolve_backend(config.attention_backend, device.type),
                    cpu_weights)


def sampler_argmax(device: torch.device) -> Argmax:
    """The sampler's argmax: on the CPU the C++ one (one pass, threads by size), else
    torch's on the device."""
    return cpu_argmax if device.type == "cpu" else torch_argmax


def sampler_draw(device: torch.device) -> Draw | None:
    """The sampler's one-call draw of rows with a temperature only: the C++ one on the
    CPU (``cpu_draw``), else None (torch's ops on the device)."""
    return cpu_draw if device.type == "cpu" else None


def applies_host_policies(device: str | torch.device) -> bool:
    """Whether this process takes the CPU thread and allocator policies (worker/threads.py):
    an engine that computes on the CPU does; a GPU engine keeps torch's defaults."""
    dev = resolve_device(device) if isinstance(device, str) else device
    return dev.type == "cpu"


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    """The dtype knob for this device (``auto``: fp32 on the CPU, the checkpoint's on CUDA)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and the oracle runs fp32
        if isinstance(checkpoint_dtype, torch.dtype) and checkpoint_dtype != torch.float32:
            return checkpoint_dtype
        return torch.bfloat16
    try:
        return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None


def resolve_cpu_weights(config: EngineConfig, device: torch.device) -> str | None:
    """The format the CPU linear layers pack their weights in (kernels/cpu/linear.py), or
    None where the model runs its own dtype through ``F.linear`` (CUDA, cpu_gemm=torch).

    A packed CPU model computes in fp32 whatever its weights hold: ``dtype`` bfloat16 /
    float16 means 16-bit weights, ``quantization`` int8 8-bit ones."""
    if device.type != "cpu":
        if config.quantization:
            raise ValueError(f"quantization={config.quantization} runs on the CPU only "
                             "(fbgemm's int8 GEMM): drop it on CUDA")
        return None
    if config.cpu_gemm != "onednn":
        return None
    fmt = config.quantization or {
        torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        resolve_dtype(config.dtype, device, None)]
    _check_cpu_format(fmt, cpu_kernels())
    return fmt


@functools.cache
def cpu_kernels() -> CpuKernels:
    """This CPU's kernels, decided once per process from its flags and logged: the C++
    kernels' instruction-set copy and each weight format's batched path (the table in
    this module's docstring). The CPU kernels run what this chose (kernels/cpu/isa.py)."""
    from triptych.kernels.cpu import isa

    cpu = cpu_features.detect()
    variant = isa.best_variant(cpu.flags)
    batched = {"float32": "onednn" if variant == "generic" else "panels",
               "bfloat16": "onednn" if _onednn_bf16(cpu) else "panels",
               "float16": "fbgemm", "int8": "fbgemm"}
    # fbgemm's VNNI kernels are AVX-512 ones: AVX-VNNI alone still saturates (checked with
    # FBGEMM_ENABLE_INSTRUCTIONS=AVX512 on a VNNI CPU)
    kernels = isa.CpuKernels(variant, batched, int8_vnni=cpu.has("avx512_vnni"))
    isa.choose(kernels)
    logger.info("CPU %s; C++ kernels: the %s copy; batched GEMMs: %s; int8 activations: %s",
                cpu.summary(), variant, ", ".join(f"{k} {v}" for k, v in batched.items()),
                "8-bit (VNNI)" if kernels.int8_vnni else "7-bit (no AVX-512 VNNI)")
    return kernels


def _onednn_bf16(cpu: cpu_features.CpuFeatures) -> bool:
    """oneDNN's bf16 inner product runs here: its own condition (avx512bw/vl/dq, or
    avx_ne_convert), and torch agrees (it honours ONEDNN_MAX_CPU_ISA set by hand)."""
    if not (cpu.has("avx512bw", "avx512vl", "avx512dq") or cpu.has("avx_ne_convert")):
        return False
    return bool(torch.backends.mkldnn.is_available()) and \
        bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _check_cpu_format(fmt: str, kernels: CpuKernels) -> None:
    """Refuse, in one line, a weight format nothing here runs well."""
    from triptych.kernels.cpu import linear, panel_gemm

    runs = {f: linear.available(f) for f in linear.FORMATS}
    if kernels.batched["bfloat16"] == "panels":  # no oneDNN bf16: ours or nothing
        runs["bfloat16"] = panel_gemm.loaded()
    if runs[fmt]:
        return
    flag = "--quantization int8" if fmt == "int8" else f"--dtype {fmt}"
    why = {"bfloat16": "oneDNN's bf16 GEMM needs avx512bw/vl/dq or avx_ne_convert and "
                       "triptych's own C++ kernels did not build (install g++)",
           "float16": "this torch build has no fbgemm", "int8": "this torch build has no fbgemm",
           "float32": "this torch build has no oneDNN"}[fmt]
    good = [("--quantization int8" if f == "int8" else f"--dtype {f}")
            for f in linear.FORMATS if runs[f]]
    raise ValueError(f"{flag} does not run well on this CPU ({why}); formats that do: "
                     f"{', '.join(good) or 'none: use --cpu-gemm torch'}")


def cpu_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the vocab; for contiguous fp32 host logits the C++ one (one pass,
    one thread per 64 MiB of logits: docs/performance.md, "Batch 32"), same result."""
    from triptych.kernels.cpu import panel_gemm

    cpu_kernels()  # the variant the argmax runs (a no-op once the engine has chosen)
    if logits.dim() == 2 and logits.is_contiguous() and logits.numel() and \
            logits.dtype == torch.float32 and panel_gemm.loaded():
        return panel_gemm.argmax(logits)
    return logits.argmax(dim=-1)


DRAW_MAX_ELEMENTS = 8192  # random rows x vocabulary drawn by the C++ call at most: beyond,
# torch's vectorised softmax and cumsum are as fast (2-core EPYC: 16 rows x 272 or one row
# x 4,096 broke even; one row x 272, the demo's, 4.5 us against 13.7 us of ~13 torch ops)


def cpu_draw(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
             u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """The random rows of a step drawn in one C++ call (kernels/cpu/panel_gemm.py), for
    contiguous fp32 host logits, rows x vocabulary up to DRAW_MAX_ELEMENTS; None otherwise
    (the sampler's torch ops). The same inverse-CDF draw at the same uniforms as those."""
    from triptych.kernels.cpu import panel_gemm

    if logits.dim() == 2 and logits.is_contiguous() and logits.dtype == torch.float32 and \
            0 < rows.numel() * logits.shape[1] <= DRAW_MAX_ELEMENTS and \
            ids.is_contiguous() and panel_gemm.loaded():
        return panel_gemm.draw(logits, rows, temperature, u, ids)
    return None
