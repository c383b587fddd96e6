"""The P0 (API server) <-> P1 (engine process) contract: msgspec Structs over ZMQ.

A message is a multipart ZMQ message: frame 0 is the msgpack-encoded Struct, the
following frames are raw tensor bytes described by ``TensorMeta`` entries in it (dtype,
shape), validated before they are viewed. Nothing is pickled.
"""
from __future__ import annotations

import math

import msgspec
import torch
from triptych.engine.sampling_params import SamplingParams

MAX_FRAME_BYTES = 256 << 20  # one tensor frame at most
MAX_MESSAGE_BYTES = 1 << 30  # one multipart message at most (ZMQ drops bigger ones)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TensorMeta(msgspec.Struct, frozen=True):
    dtype: str  # one of _DTYPES
    shape: list[int]  # dims; the frame must hold exactly prod(shape) * itemsize bytes


class WireMMItem(msgspec.Struct, frozen=True):
    modality: str  # "image" | "video"
    mm_hash: str  # content hash (cache key)
    offset: int  # first placeholder token in prompt_token_ids
    length: int  # placeholder tokens
    grid_thw: list[int]  # (t, h, w) patch grid
    pixels: TensorMeta  # pixel_values, in the frame at this item's index + 1
    second_per_grid_t: float | None = None  # video only


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str  # server-made id (client ids are labels only)
    prompt_token_ids: list[int]  # expanded prompt
    params: SamplingParams  # validated sampling params
    mm_items: list[WireMMItem] = []  # items, tensors in the following frames, in order
    prompt: str | None = None  # prompt text, for the output only


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]  # requests to stop and free


class StatsRequest(msgspec.Struct, tag="stats"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToEngine = AddRequest | AbortRequest | StatsRequest | Shutdown


class CompletionDelta(msgspec.Struct):
    index: int  # which of the n completions
    text: str  # text added since the last delta
    token_ids: list[int]  # ids added since the last delta
    finish_reason: str | None  # set once, on the last delta
    stop_reason: int | str | None = None  # stop token id / string that finished it
    logprobs: list[dict[int, float]] | None = None  # per new token: top ids -> logprob


class RequestDelta(msgspec.Struct, tag="delta"):
    request_id: str  # which request
    completions: list[CompletionDelta]  # the completions that advanced
    finished: bool  # every completion is done
    num_prompt_tokens: int  # for usage
    num_cached_tokens: int  # prompt tokens served from the prefix cache


class RequestError(msgspec.Struct, tag="error"):
    request_id: str  # the request the engine refused
    message: str  # safe for the client: names the problem, no internals


class EngineStats(msgspec.Struct, tag="stats"):
    values: dict[str, float]  # LLMEngine.stats() gauges and counters


FromEngine = RequestDelta | RequestError | EngineStats

_enc = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: msgspec.Struct, tensors: list[torch.Tensor] | None = None) -> list[bytes]:
    frames = [_enc.encode(msg)]
    for t in tensors or []:  # raw bytes (bf16 has no numpy dtype: go through uint8)
        frames.append(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return frames


def decode_to_engine(frames: list[bytes]) -> ToEngine:
    return _to_engine.decode(frames[0])


def decode_from_engine(frame: bytes) -> FromEngine:
    return _from_engine.decode(frame)


def tensor_from_frame(meta: TensorMeta, frame: bytes) -> torch.Tensor:
    """View a frame as a tensor after checking dtype, shape and byte length."""
    if meta.dtype not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {meta.dtype!r}")
    if len(meta.shape) > 4 or any(type(s) is not int or s < 0 for s in meta.shape):
        raise ValueError("bad tensor shape")
    dtype = _DTYPES[meta.dtype]
    # NOTE: math.prod on Python ints cannot overflow (np.prod wraps around to 0 for a
    # forged shape like [2**32, 2**32], which would then "match" an empty frame).
    nbytes = math.prod(meta.shape) * torch.tensor([], dtype=dtype).element_size()
    if nbytes > MAX_FRAME_BYTES or len(frame) != nbytes:
        raise ValueError("tensor frame size does not match its shape")
    buf = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return buf.view(dtype).view(meta.shape)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(str(t.dtype).removeprefix("torch."), list(t.shape))
