"""What a device uses, decided in one place.

    device   attention kernels       linear layers            sampler's argmax   host policies
    cpu      cpu (C++ decode + fused  packed (oneDNN / fbgemm,  C++ (panel_gemm)   threads +
             ops) or torch           GEMV, panel GEMM)                            allocator
    cuda     triton (or torch)       F.linear in the model's  torch, on device   none
                                     dtype

Everything CPU-specific (kernels/cpu/ and its C++ builds, worker/threads.py and
worker/allocator.py) is reached only through the CPU's choices here: a CUDA engine never
imports, builds or runs it. The step's host/device traffic is engine/device_io.py (on the
CPU it copies nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from triptych.config import EngineConfig
from triptych.engine.sampler import Argmax, torch_argmax


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
    if config.quantization:
        return config.quantization
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        resolve_dtype(config.dtype, device, None)]


def cpu_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the vocab; for contiguous fp32 host logits the C++ one (one pass,
    one thread per 64 MiB of logits: docs/performance.md, "Batch 32"), same result."""
    from triptych.kernels.cpu import panel_gemm

    if logits.dim() == 2 and logits.is_contiguous() and logits.numel() and \
            logits.dtype == torch.float32 and panel_gemm.loaded():
        return panel_gemm.argmax(logits)
    return logits.argmax(dim=-1)
