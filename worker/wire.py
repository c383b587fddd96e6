"""The router (P0) <-> worker contract: msgspec Structs over ZMQ, tensors as raw frames.

A message is a multipart ZMQ message: frame 0 is the msgpack-encoded Struct, the
following frames are raw tensor bytes described by ``TensorMeta`` entries in it (dtype,
shape), validated before they are viewed. Nothing is pickled. Each side decodes with a
decoder fixed to the union it accepts, so a peer cannot make it build any other type.

    router --ToWorker-->  worker     AddRequest / EncodeRequest / ReserveKV / AbortRequest /
                                     Shutdown
    router <--FromWorker-- worker    Hello / StepOutputs / RequestError / WorkerStats /
                                     KVReserved / EncodeDone / NeedEmbeddings / HandBack
    worker --DataMsg--> worker       EmbeddingTransfer (encode -> prefill) / KVTransfer
                                     (prefill -> decode), through a connector (connector/)

Addresses a worker connects to (a peer's data address) come from the router, which took
them from the peers' Hello messages: never from a client.

``RequestDelta`` / ``CompletionDelta`` are what the router hands the HTTP layer (text per
completion); they stay inside the API process.
"""
from __future__ import annotations

import math

import msgspec
import torch
from triptych.engine.outputs import EngineCoreOutput
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.mmcache.shm_ring import ShmItemRef

MAX_FRAME_BYTES = 256 << 20  # one frame at most: a bigger tensor spans several (frames_of)
MAX_MESSAGE_BYTES = 1 << 30  # ZMQ_MAXMSGSIZE: libzmq checks it per frame (part), so a
# chunked tensor of any size passes; what bounds pixels is the model's context (the processor)
MAX_TENSOR_BYTES = 16 << 30  # one tensor at most, summed over its frames (a forged shape
# cannot make the receiver allocate more)
MAX_TENSOR_DIMS = 6
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
    pixels: TensorMeta | None = None  # dtype/shape of pixel_values (in the next unused
    # frame unless cached); None: no pixels, the worker holds or will get the embedding
    second_per_grid_t: float | None = None  # video only
    cache: str = ""  # processor cache op (mmcache/consumer.py): "" | data | data-uncached |
    # ref (the worker's store holds the pixels) | shm (read them from P0's ring)
    shm: ShmItemRef | None = None  # where in P0's ring (cache == "shm")


# -- router -> worker ---------------------------------------------------------------------------
class KVDest(msgspec.Struct, frozen=True):
    """Where a prefill worker sends a request's KV (from the decode worker's KVReserved)."""

    worker: str  # the decode worker's name (logs, metrics)
    address: str  # its data-plane address (router-made, from its Hello)
    num_blocks: int  # blocks of the request's KV the decode worker reserved in all
    num_cached_blocks: int  # leading blocks its prefix cache already holds: not sent
    rank_addresses: list[str] = []  # a tensor-parallel decode group: each rank's data
    # address (rank 0's first); a prefill group of the same size sends rank to rank


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str  # router-made id (client ids are labels only, never sent here)
    prompt_token_ids: list[int]  # expanded prompt
    params: SamplingParams  # one completion (n == 1): the router fans n out
    mm_items: list[WireMMItem] = []  # items; tensors in the following frames, in order
    output_token_ids: list[int] = []  # tokens already streamed (a request resumed here
    # after its worker died): recomputed, never emitted again
    kv_dest: KVDest | None = None  # prefill worker: stop after one new token, send the KV here
    encoding: list[str] = []  # mm hashes an encode worker was asked to send here (items
    # without pixels that are not listed are expected in this worker's encoder cache)
    cache_evicted: list[str] = []  # processor-cache keys the worker drops first (P0's plan)
    cache_seq: int = 0  # the plan's number (comes back with a cache miss)


class EncodeRequest(msgspec.Struct, tag="encode"):
    request_id: str  # the request the items belong to (for errors and logs)
    mm_items: list[WireMMItem]  # items to encode, pixels in the following frames
    dest_address: str  # data address of the worker that prefills the request
    cache_evicted: list[str] = []  # as AddRequest's
    cache_seq: int = 0


class ReserveKV(msgspec.Struct, tag="reserve"):
    """Decode worker: hold blocks for a request whose KV a prefill worker will send."""

    request_id: str
    prompt_token_ids: list[int]  # expanded prompt (the decode worker re-validates it)
    params: SamplingParams
    mm_items: list[WireMMItem] = []  # placeholder ranges and hashes only (no pixels)
    output_token_ids: list[int] = []  # tokens streamed before (a resumed request)


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]  # requests to stop and free


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToWorker = AddRequest | EncodeRequest | ReserveKV | AbortRequest | Shutdown


# -- worker -> router ---------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    worker_id: str  # the name the supervisor gave it (pool-index), plus its incarnation
    pool: str  # colocated | encode | prefill | decode
    pid: int  # for /health and the supervisor
    max_model_len: int  # what this worker accepts
    num_kv_blocks: int  # its KV cache size (0 for encode workers)
    data_address: str = ""  # its connector endpoint (pools), where peers send data
    encoder_cache_bytes: int = 0  # embedding bytes it can keep (router's encode routing)
    rank_addresses: list[str] = []  # a tensor-parallel group's data addresses, rank by rank
    model_fingerprint: str = ""  # config + weights digest (worker/fingerprint.py): a worker
    # on another host with another checkpoint is refused before it joins a pool
    weight_parts: str = ""  # all | vision | language: the submodules it loaded (/health)
    weight_bytes: dict[str, int] = {}  # its resident weight bytes per part, measured
    rank_weight_bytes: list[dict[str, int]] = []  # a group's: each rank's, rank 0 first
    gpu_memory_share: float = 0.0  # CUDA: the share of its device it measured it needs
    # (an encode worker without --encode-gpu-memory-utilization); 0: not measured


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]  # one step's token outputs


class RequestError(msgspec.Struct, tag="error"):
    request_id: str  # the request the worker refused
    message: str  # safe for the client: names the problem, no internals
    retryable: bool = False  # not the request's fault (a transfer timed out): run it again
    cache_missing: list[str] = []  # processor-cache keys the worker did not hold (retryable)
    cache_seq: int = 0  # the plan that named them


class WorkerStats(msgspec.Struct, tag="stats"):
    values: dict[str, float]  # EngineCore.stats() gauges and counters


HEARTBEAT_SUFFIX = "~hb"  # a worker's heartbeat socket: its identity plus this


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent every HEARTBEAT_INTERVAL_S by a thread of its own on a socket of its own
    (identity + HEARTBEAT_SUFFIX): it stops only when the whole process stops (frozen,
    SIGSTOP, dead), never because the loop is inside a long step."""

    busy_s: float = 0.0  # seconds the loop has been inside the current step (0: idle);
    # /health shows it (a step that never ends is visible, not killed: see liveness notes)


class KVReserved(msgspec.Struct, tag="reserved"):
    request_id: str  # blocks are held for it (lease: kv_transfer_timeout)
    num_blocks: int  # blocks reserved in all (prompt + resumed tokens)
    num_cached_blocks: int  # leading blocks found in its prefix cache: not to be sent


class EncodeDone(msgspec.Struct, tag="encoded"):
    request_id: str
    mm_hashes: list[str]  # embeddings sent to the destination


class NeedEmbeddings(msgspec.Struct, tag="need"):
    request_id: str  # a prefill-side worker lacks these embeddings (evicted): encode again
    mm_hashes: list[str]


class HandBack(msgspec.Struct, tag="handback"):
    """A decode worker gives a request back (preempted and not recomputable here: its
    images' embeddings live elsewhere); the router re-runs it from these tokens."""

    request_id: str
    output_token_ids: list[int]  # every output token so far


FromWorker = (Hello | StepOutputs | RequestError | WorkerStats | KVReserved | EncodeDone
              | NeedEmbeddings | HandBack | Heartbeat)


# -- worker -> worker (data plane, through a connector) -----------------------------------------
class EmbeddingTransfer(msgspec.Struct, tag="emb"):
    request_id: str  # the request that needs it
    mm_hash: str  # key of the embedding; tensor 0: [rows, hidden]


class KVTransfer(msgspec.Struct, tag="kv"):
    """A run of a request's KV blocks; tensor 0: [num_layers, 2, n, block_size, Hkv, D]."""

    request_id: str
    first_block: int  # index (in the request's block list) of the first block carried
    final: bool = False  # the last chunk: every block has been sent
    first_token: int = -1  # with final: the token the prefill worker sampled
    sliced: bool = False  # tensor 0 holds rank 0's KV heads only; every other rank of the
    # prefill group sent its slice to the same rank of the decode group (KVSlice)


class KVSlice(msgspec.Struct, tag="kvslice"):
    """One rank's KV heads of a run of blocks, rank to rank between tensor-parallel groups;
    tensor 0: [num_layers, 2, n, block_size, local KV heads, head_dim]."""

    request_id: str
    first_block: int  # the KVTransfer (from rank 0) this slice belongs with
    rank: int  # the sender's rank (the receiver's must be the same)


DataMsg = EmbeddingTransfer | KVTransfer


# -- inside the API process: router -> HTTP layer ------------------------------------------------
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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once (prompt_logprobs)


_enc = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: msgspec.Struct, tensors: list[torch.Tensor] | None = None) -> list[bytes]:
    """Frames of one message. Raises ValueError for values that cannot travel (ints
    beyond 64 bits, ...): the caller refuses that request only."""
    try:
        frames = [_enc.encode(msg)]
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        raise ValueError(f"the request has a value that cannot be sent: {e}") from None
    return frames + encode_tensors(tensors or [])


def encode_tensors(tensors: list[torch.Tensor]) -> list[bytes]:
    """Raw bytes of each tensor (bf16 has no numpy dtype: go through uint8), a tensor over
    MAX_FRAME_BYTES in consecutive frames of at most that size (``frames_of`` says how
    many; an empty tensor is one empty frame)."""
    out: list[bytes] = []
    for t in tensors:
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out += [raw[i:i + MAX_FRAME_BYTES].tobytes()
                for i in range(0, max(len(raw), 1), MAX_FRAME_BYTES)]
    return out


def _nbytes(meta: TensorMeta) -> int:
    if meta.dtype not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {meta.dtype!r}")
    if len(meta.shape) > MAX_TENSOR_DIMS or any(type(s) is not int or s < 0 for s in meta.shape):
        raise ValueError("bad tensor shape")
    # NOTE: math.prod on Python ints cannot overflow (np.prod wraps around to 0 for a
    # forged shape like [2**32, 2**32], which would then "match" an empty frame).
    nbytes = math.prod(meta.shape) * torch.tensor([], dtype=_DTYPES[meta.dtype]).element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(f"a tensor of {nbytes} bytes is over the {MAX_TENSOR_BYTES} byte cap")
    return nbytes


def frames_of(meta: TensorMeta) -> int:
    """How many frames the tensor ``meta`` describes travels in. Raises ValueError."""
    return max(1, -(-_nbytes(meta) // MAX_FRAME_BYTES))


def tensor_from_frames(meta: TensorMeta, frames: list[bytes]) -> torch.Tensor:
    """A tensor sent in ``frames_of(meta)`` frames, after checking dtype, shape, frame
    count and every frame's length."""
    nbytes = _nbytes(meta)
    if len(frames) != frames_of(meta):
        raise ValueError("tensor frames do not match the items")
    if len(frames) == 1:
        return tensor_from_frame(meta, frames[0])
    want = [min(MAX_FRAME_BYTES, nbytes - i) for i in range(0, nbytes, MAX_FRAME_BYTES)]
    if [len(f) for f in frames] != want:
        raise ValueError("tensor frame size does not match its shape")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for i, f in zip(range(0, nbytes, MAX_FRAME_BYTES), frames):
        buf[i:i + len(f)] = torch.frombuffer(f, dtype=torch.uint8)
    return buf.view(_DTYPES[meta.dtype]).view(meta.shape)


def decode_to_worker(frames: list[bytes]) -> ToWorker:
    return _to_worker.decode(frames[0])


def decode_from_worker(frame: bytes) -> FromWorker:
    return _from_worker.decode(frame)


def tensor_from_frame(meta: TensorMeta, frame: bytes | memoryview) -> torch.Tensor:
    """View one frame as a tensor after checking dtype, shape and byte length."""
    nbytes = _nbytes(meta)
    dtype = _DTYPES[meta.dtype]
    if nbytes > MAX_FRAME_BYTES or len(frame) != nbytes:
        raise ValueError("tensor frame size does not match its shape")
    buf = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return buf.view(dtype).view(meta.shape)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(str(t.dtype).removeprefix("torch."), list(t.shape))
