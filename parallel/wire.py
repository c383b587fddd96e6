"""Rank 0 -> ranks 1..N-1 of a tensor-parallel group: one command per collective section.

A command is a multipart ZMQ message (ipc, the group's private directory): frame 0 the
msgpack Struct, then raw tensor frames described by its ``ArrayMeta`` entries, checked
before they are viewed. Nothing is pickled. Each command is self-contained (the ranks keep
no request state): every rank runs it and joins the same collectives in the same order.

    Forward    one model step: the flat batch (StepInputs arrays) and the vision rows to
               write over placeholder embeddings; logits slices are gathered to rank 0
    Encode     one vision-tower call: every item's grid, this rank's pixels (all of them in
               "weights" mode, its share in "data" mode) and the assignment
    ReadKV     gather these KV blocks' head slices to rank 0 (a prefill worker's export)
    WriteKV    write this rank's head slice of these KV blocks (a decode worker's import)
    SizeKV     after rank 0's profile run (CUDA): size this rank's KV cache from its share
               of its device, agree on the group's smallest, allocate it
    Stop       leave the loop
"""
from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

MAX_FRAME_BYTES = 1 << 31
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32}


class ArrayMeta(msgspec.Struct, array_like=True, frozen=True):
    dtype: str  # one of _DTYPES
    shape: list[int]


class Forward(msgspec.Struct, tag="forward"):
    max_query_len: int  # longest query chunk of the step (1: pure decode)
    arrays: list[ArrayMeta]  # STEP_ARRAYS in order, then the vision rows (if any)
    mm_rows: list[int] = []  # flat row where each vision span starts
    mm_lens: list[int] = []  # rows of each span (their embeddings are one frame, in order)


class Encode(msgspec.Struct, tag="encode"):
    grid: list[list[int]]  # (t, h, w) of every item of the batch, in batch order
    ranks: list[list[int]]  # "data": item indices per rank; "weights": [] (all on all)
    pixels: ArrayMeta  # this rank's pixel rows, its items in batch order


class ReadKV(msgspec.Struct, tag="read_kv"):
    block_ids: list[int]


class WriteKV(msgspec.Struct, tag="write_kv"):
    block_ids: list[int]
    kv: ArrayMeta  # [num_layers, 2, n, block_size, local KV heads, head_dim]


class SendKV(msgspec.Struct, tag="send_kv"):
    """Send this rank's heads of these blocks to its counterpart in a decode group."""

    block_ids: list[int]
    peer: str  # the decode group's rank of the same number (its data address)
    request_id: str
    first_block: int


class RecvKV(msgspec.Struct, tag="recv_kv"):
    """Take this rank's slice of a transfer (from its counterpart) into these blocks."""

    block_ids: list[int]  # the decode worker's reservation, chosen by rank 0
    request_id: str
    first_block: int
    timeout_s: float  # the slice left before rank 0 got the transfer's header: short


class SizeKV(msgspec.Struct, tag="size_kv"):
    """The profile run is over: each rank computes the blocks its share of its device holds
    after what it measured, the group takes the smallest (one ``min_int``), all allocate."""


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = Forward | Encode | ReadKV | WriteKV | SendKV | RecvKV | SizeKV | Stop
STEP_ARRAYS = ("input_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q",
               "seq_lens", "sample_rows", "logits_index")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


def meta(t: torch.Tensor | np.ndarray) -> ArrayMeta:
    return ArrayMeta(str(t.dtype).removeprefix("torch."), list(t.shape))


def frame(t: torch.Tensor | np.ndarray) -> memoryview:
    """The bytes of a host tensor or array (bfloat16 has no numpy dtype: sent as int16)."""
    if not math.prod(t.shape):
        return memoryview(b"")
    if isinstance(t, np.ndarray):
        return memoryview(np.ascontiguousarray(t)).cast("B")
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def encode(cmd: Command, tensors: list[torch.Tensor | np.ndarray] = ()) -> list:
    return [_encoder.encode(cmd), *(frame(t) for t in tensors)]


def decode(frames: list) -> tuple[Command, list[torch.Tensor]]:
    """The command and its tensors (host, writable copies), checked against their metas."""
    cmd = _decoder.decode(frames[0])
    metas = (cmd.arrays if isinstance(cmd, Forward) else [cmd.pixels] if isinstance(cmd, Encode)
             else [cmd.kv] if isinstance(cmd, WriteKV) else [])
    if len(metas) != len(frames) - 1:
        raise ValueError(f"{len(frames) - 1} tensor frames for {len(metas)} arrays")
    return cmd, [_view(m, f) for m, f in zip(metas, frames[1:])]


def _view(m: ArrayMeta, data: bytes | memoryview) -> torch.Tensor:
    if m.dtype not in _DTYPES or any(type(s) is not int or s < 0 for s in m.shape):
        raise ValueError(f"bad array {m}")
    dtype = _DTYPES[m.dtype]
    nbytes = math.prod(m.shape) * torch.tensor([], dtype=dtype).element_size()
    if nbytes > MAX_FRAME_BYTES or len(data) != nbytes:
        raise ValueError("tensor frame size does not match its shape")
    if not nbytes:
        return torch.empty(m.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(m.shape)
