"""What every connector message carries on the wire, and the checks made before use.

A message is a ZMQ multipart message. Frame 0 is an ``Envelope`` (msgpack): the caller's
own header Struct as raw msgpack, one ``TensorSpec`` per tensor (dtype, shape, byte
length), and where the tensor bytes are: in the following frames (tcp), in one
shared-memory segment (shm), or in the receiving endpoint's in-process stash (inproc).
Nothing is pickled. The receiver decodes the envelope with a fixed type, checks every spec
against its ``Limits`` and only then views bytes as tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

# NOTE: an allow-list, not getattr(torch, name): a peer must not pick arbitrary attributes.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
                 "int8", "uint8", "int16", "int32", "int64")
    if hasattr(torch, name)
}


@dataclass(frozen=True)
class Limits:
    """Bounds a receiver enforces on every message (the sender checks them too)."""

    max_message_bytes: int = 1 << 30  # tensor bytes in one message
    max_tensors: int = 4096  # tensors in one message (a KV transfer: 2 per layer)
    max_ndim: int = 8  # dims of one tensor
    max_header_bytes: int = 1 << 20  # frame 0 (envelope + the caller's header)


DEFAULT_LIMITS = Limits()


class TensorSpec(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    dtype: str  # a key of DTYPES
    shape: list[int]  # dims, each >= 0
    nbytes: int  # must equal prod(shape) * itemsize
    offset: int = 0  # shm only: byte offset of this tensor in the segment


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    header: msgspec.Raw  # the caller's Struct, msgpack; decoded with the receiver's type
    tensors: list[TensorSpec]  # one per tensor, in the order given to send()
    sent_at: float  # sender's time.time() when send() began (latency metric only)
    segment: str | None = None  # shm: name of the segment under /dev/shm holding the tensors
    segment_size: int = 0  # shm: that segment's size in bytes
    ref: int = 0  # inproc: key of the tensors in the receiving endpoint's stash


ENCODER = msgspec.msgpack.Encoder()
ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)


class ConnectorError(RuntimeError):
    """Base of every error a connector raises."""


class BadMessage(ConnectorError):
    """One received message was malformed and dropped; the endpoint keeps working.

    ``header`` is the decoded header when the damage was past it (so the caller can fail
    that one request), else None.
    """

    def __init__(self, reason: str, header: msgspec.Struct | None = None) -> None:
        super().__init__(reason)
        self.header = header


class SendTimeout(ConnectorError):
    """The peer did not take the message within the send timeout (absent, slow, or refused
    our CURVE handshake)."""


def spec_of(t: torch.Tensor, offset: int = 0) -> TensorSpec:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConnectorError(f"dtype {name} cannot travel through the connector")
    return TensorSpec(name, list(t.shape), t.numel() * t.element_size(), offset)


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array in host memory (no copy when already a
    contiguous CPU tensor; bf16/fp8 have no numpy dtype, so go through uint8)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def check_specs(specs: list[TensorSpec], limits: Limits) -> int:
    """Validate every spec (dtype known, shape bounded, byte length exact); return the
    total bytes. Raises BadMessage."""
    if len(specs) > limits.max_tensors:
        raise BadMessage(f"{len(specs)} tensors in one message (limit {limits.max_tensors})")
    total = 0
    for s in specs:
        dtype = DTYPES.get(s.dtype)
        if dtype is None:
            raise BadMessage(f"unsupported tensor dtype {s.dtype[:32]!r}")
        if len(s.shape) > limits.max_ndim or any(d < 0 for d in s.shape):
            raise BadMessage("bad tensor shape")
        # NOTE: math.prod on Python ints cannot wrap around (np.prod can, to 0, so a forged
        # shape like [2**32, 2**32] would "match" an empty buffer).
        nbytes = math.prod(s.shape) * dtype.itemsize
        if nbytes != s.nbytes:
            raise BadMessage("tensor byte length does not match its dtype and shape")
        if s.offset < 0:
            raise BadMessage("negative tensor offset")
        total += nbytes
        if total > limits.max_message_bytes:
            raise BadMessage(f"message over {limits.max_message_bytes} bytes")
    return total


def as_tensor(spec: TensorSpec, flat: torch.Tensor) -> torch.Tensor:
    """View checked uint8 bytes as the spec's tensor (caller has matched the length)."""
    if flat.numel() != spec.nbytes:
        raise BadMessage("tensor bytes do not match their spec")
    dtype = DTYPES[spec.dtype]
    if flat.data_ptr() % dtype.itemsize:  # a misaligned frame: copy to aligned memory
        flat = flat.clone()
    return flat.view(dtype).view(spec.shape)
