"""EngineConfig: every knob in one place, with vLLM's names, validated once.

Parts of the engine receive the few values they need, never this whole object; derived
values (number of KV blocks, resolved dtype) are computed once by the engine and passed
explicitly, never written back here.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: int | float | str) -> int:
    """'4GiB' / '512MiB' / '1.5G' / 1073741824 -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"cannot parse size {value!r}; use e.g. '2GiB' or '512MiB'")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


RESOURCE_KNOBS = ("encode_resources", "prefill_resources", "decode_resources")


def _check_ray_knobs(config: EngineConfig) -> None:
    """distributed_executor_backend and the per-pool Ray resources (JSON text -> dict)."""
    if config.distributed_executor_backend not in ("mp", "ray"):
        raise ValueError("distributed_executor_backend must be mp or ray, got "
                         f"{config.distributed_executor_backend!r}")
    for name in RESOURCE_KNOBS:
        value = getattr(config, name)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be a JSON object such as "
                                 f"'{{\"vision_node\": 1}}', got {getattr(config, name)!r}")
            object.__setattr__(config, name, value)
        if value is not None and (not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and 0 <= v < float("inf")
                for k, v in value.items())):
            raise ValueError(f"{name}: resource names to non-negative numbers, got {value!r}")
        if value and config.distributed_executor_backend != "ray":
            raise ValueError(f"{name} asks Ray for resources: it needs "
                             "distributed_executor_backend=ray")
    if config.distributed_executor_backend == "ray":
        if config.worker_address is not None:
            raise ValueError("distributed_executor_backend=ray places every worker itself: "
                             "leave worker_address unset (Ray actors join over their own "
                             "CURVE socket)")
        if config.kv_transfer not in ("auto", "tcp"):
            raise ValueError("distributed_executor_backend=ray moves KV and embeddings over "
                             "tcp with CURVE (workers may be on any node): kv_transfer must "
                             "be auto or tcp")
        if config.mm_processor_cache_type == "shm":
            raise ValueError("mm_processor_cache_type=shm shares memory on one host; Ray "
                             "workers may run on other nodes: use lru")
    elif config.ray_address is not None:
        raise ValueError("ray_address needs distributed_executor_backend=ray")


# vLLM's name -> ours, where they differ (the CLI takes both spellings too, see cli.py)
ALIASES = {"num_gpu_blocks_override": "num_kv_blocks", "kv_cache_memory_bytes": "kv_cache_memory",
           "cuda_graph_max_bs": "max_cudagraph_capture_size"}  # (SGLang's spelling)
# compilation_config keys this engine takes (vLLM's names)
COMPILATION_KEYS = {"cudagraph_capture_sizes", "max_cudagraph_capture_size"}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine. Field comments are the --help text of the CLI."""

    model: str  # checkpoint directory (HF format: config.json, *.safetensors, tokenizer)
    tokenizer: str | None = None  # tokenizer directory; defaults to the model directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, checkpoint dtype on CUDA). On the CPU (cpu_gemm onednn), bfloat16/float16 store the linear layers' weights and the LM head in 16 bits (half the bytes a decode step reads) while activations, norms and the KV cache stay fp32
    device: str = "auto"  # auto | cpu | cuda (auto: cuda when available)
    seed: int = 0  # seed of the default sampling generator
    max_model_len: int | None = None  # prompt + output tokens per request (default: min(checkpoint max, 8192))
    max_num_seqs: int = 128  # requests running in one step at most
    max_num_batched_tokens: int = 2048  # tokens (prefill + decode) computed in one step at most
    block_size: int = 16  # tokens per KV cache block
    gpu_memory_utilization: float = 0.9  # CUDA: this server's share of each GPU's total memory (weights, activations, KV cache); start-up refuses when less than that is free. The KV cache is what a profile run at max_num_batched_tokens leaves of it. Pool workers on one GPU split it: encode workers take what they measure they need, prefill and decode workers (or colocated replicas) equal parts of the rest
    encode_gpu_memory_utilization: float | None = None  # CUDA: the share of its GPU each encode worker takes instead (default: what it measures: weights, peak activation, encoder cache)
    prefill_gpu_memory_utilization: float | None = None  # CUDA: the share of its GPU each prefill worker takes instead (default: an equal part of what encode leaves of gpu_memory_utilization)
    decode_gpu_memory_utilization: float | None = None  # CUDA: the share of its GPU each decode worker takes instead (the same default). The shares of all workers on one GPU must sum to at most 1
    kv_cache_memory: int | str | None = None  # bytes of KV cache of each engine worker, e.g. '2GiB', '512MiB' (vLLM: kv_cache_memory_bytes). Unset on the CPU: each colocated or decode worker takes 1GiB and each prefill worker of P+D 512MiB (it holds a prompt only until the decode side has it); unset on CUDA: what gpu_memory_utilization leaves after a profile run. Set, every prefill and decode worker takes this much, on CUDA too (no profile). Encode workers hold none
    num_kv_blocks: int | None = None  # override the computed number of KV blocks (vLLM: num_gpu_blocks_override; testing, tight memory)
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prefixes (images included via mm hashes)
    enable_chunked_prefill: bool = True  # split long prompts across steps to keep decodes flowing
    tensor_parallel_size: int = 1  # processes (one per GPU) sharing each worker's layers: every worker becomes a group of this many ranks
    data_parallel_size: int = 1  # colocated engine replicas (worker processes) behind one router
    encode_workers: int = 0  # encode pool size (vision tower); 0: the prefill (or decode) workers encode
    prefill_workers: int = 0  # prefill pool size; 0 with decode_workers > 0: decode workers prefill too (E+PD)
    decode_workers: int = 0  # decode pool size; all three 0: the colocated engine
    encode_tensor_parallel_size: int | None = None  # ranks of each encode worker (default: tensor_parallel_size)
    prefill_tensor_parallel_size: int | None = None  # ranks of each prefill worker (default: tensor_parallel_size)
    decode_tensor_parallel_size: int | None = None  # ranks of each decode worker (default: tensor_parallel_size)
    kv_transfer: str = "auto"  # how KV and embeddings move between pools: auto | shm | tcp (auto: shm on one host; inproc is for handlers in one process, refused for pools)
    kv_transfer_timeout: float = 30.0  # seconds a decode worker holds blocks for a KV transfer that has not completed
    worker_heartbeat_timeout: float = 10.0  # seconds a worker (local or remote) may send no heartbeat before it is taken for dead: killed (local), restarted, its requests run again elsewhere; it heartbeats every 0.5 s from a thread of its own, so a long step never counts as silence
    max_step_seconds: float = 300.0  # a worker inside one step (a forward pass, a vision-tower call) longer than this is taken for hung: killed (local) or dropped (remote), restarted, its requests run again elsewhere; vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS as a flag (0 disables; raise it for huge images on a CPU)
    first_token_timeout: float = 600.0  # seconds a server request may wait for its first token (queueing on the workers, encoding, prefill, KV transfer) before it fails with a 503 naming this flag and everything it held is freed (0 disables; the offline LLM has none)
    kv_transfer_host: str = "127.0.0.1"  # kv_transfer=tcp: address this host's workers bind their data endpoints to
    worker_address: str | None = None  # tcp://HOST:PORT where pool workers on other hosts register (off unless set; needs worker_keys)
    worker_keys: str | None = None  # CURVE key directory made by `triptych keys` (the router's key is named router)
    mm_encoder_tp_mode: str = "weights"  # vision tower of a tensor-parallel worker: weights shards its layers across the ranks; data keeps it whole on every rank and splits each batch of images across them by patch count
    mm_processor_cache_gb: float = 4.0  # GiB of processed pixels each side of the processor cache may hold (0 disables both sides)
    mm_processor_cache_type: str = "lru"  # lru: P0 keeps keys, each worker keeps the tensors | shm: P0 writes a shared-memory ring every worker on the host reads
    mm_preprocessor: str = "fast"  # how P0 makes an image's pixel values: fast (Pillow's resize as vectorised C++ passes, compiled by g++ on first use, Pillow's own without a compiler; then one table lookup per sample straight into the patch layout: HF's values bit for bit at a fraction of the cost) | hf (HF's image processor itself)
    encoder_cache_size: int | str = "256MiB"  # bytes of vision embeddings kept for reuse, e.g. '512MiB' (0 disables; repeated images skip the tower)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8, "video": 1})  # items per prompt
    allowed_local_media_path: str | None = None  # local image/video paths are allowed only under this directory
    tenant_step_share: float = 0.25  # on a server with API keys, when several tenants' requests have work, the busiest tenant (most tokens, sequences and context asked) is held to a cap so that steps with it take at most (1 + this) x the steps without it, measured (one contended step in 8 runs without it, one in 64 while it costs the others little); past the cap its sequences take turns (8 steps each) and its prompt chunks are cut. No tenant is held below what the busiest other tenant asks, and a tenant alone keeps the whole step. 0.25: another tenant's token takes at most ~1.25x as long as without the busiest (on the 2-core demo server a chat beside n=16 long answers reads 1.3-1.6x its idle latency, beside 128 sequences of another tenant 1.2-1.4x; the busiest's answer a twentieth slower). 0: off (first come, first served, as vLLM)
    max_grammar_step_ms: float = 0.0  # a structured-output request whose grammar work (its mask and matcher update) costs more than this in 3 steps running is ended with an error naming this flag; 0: auto, half the step's own time without grammar work (at least 0.25 ms), so one request's grammar can make its batch-mates' step at most 1.5x as long
    attention_backend: str | None = None  # torch | cpu | triton; unset: triton on CUDA, cpu on a CPU (torch with the decode attention fused in C++, compiled by g++ on first use and cached in $TORCH_EXTENSIONS_DIR/triptych, else ~/.cache/torch_extensions/triptych), torch when no compiler is found
    disable_log_stats: bool = False  # no periodic throughput / cache log lines
    cpu_gemm: str = "onednn"  # fp32 linear layers on the CPU: onednn runs them on weights packed once at load (2-3x faster GEMMs than torch's MKL path, measured on AMD EPYC; each GEMM uses the threads its size pays for) | torch keeps F.linear
    quantization: str | None = None  # int8: the CPU linear layers' weights and the LM head in 8 bits (per-channel, fbgemm's dynamic int8 GEMM; a quarter of fp32's bytes; quality cost in docs/performance.md); CPU only, needs cpu_gemm onednn
    distributed_executor_backend: str = "mp"  # how pool workers are started: mp (local processes, watched by this server) | ray (each worker a Ray actor in a placement group of the cluster at --ray-address; see docs/ray.md)
    ray_address: str | None = None  # distributed_executor_backend=ray: the cluster to join (default: auto when RAY_ADDRESS is set, else a Ray started for this server alone)
    encode_resources: dict[str, float] | str | None = None  # distributed_executor_backend=ray: JSON resources each encode worker asks of Ray on top of one CPU per rank (GPU per rank with --device cuda), e.g. '{"vision_node": 1}' to pin the pool to nodes started with that custom resource; "CPU"/"GPU" given here are per rank
    prefill_resources: dict[str, float] | str | None = None  # the same for each prefill worker
    decode_resources: dict[str, float] | str | None = None  # the same for each decode (or colocated) worker
    async_scheduling: bool | None = None  # schedule and prepare step N+1 while the device runs step N, reading step N's sampled ids only after N+1 is launched (vLLM's --async-scheduling): the host's work overlaps the device's. Unset: on with CUDA (not with tensor parallelism), off on the CPU, where the device is the host and nothing overlaps
    enforce_eager: bool = True  # CUDA: run every step eagerly. --no-enforce-eager captures decode steps as CUDA graphs per padded batch size (engine/device/cuda_graphs.py; prefill and mixed steps stay eager). Graphs are opt-in until their figures are taken on a GPU (docs/performance.md); vLLM's default is graphs on. SGLang's --disable-cuda-graph is an alias
    compilation_config: dict[str, Any] | str | None = None  # JSON, vLLM's: {"cudagraph_capture_sizes": [1, 2, 4, 8, ...], "max_cudagraph_capture_size": 256}: the decode batch sizes captured as CUDA graphs (default 1, 2, 4 and multiples of 8 up to max_num_seqs, at most 256); a step of more rows runs eagerly
    max_cudagraph_capture_size: int | None = None  # the largest decode batch captured as a CUDA graph (compilation_config's key as a flag; SGLang: --cuda-graph-max-bs)
    cpu_threads: int | None = None  # torch CPU threads of each engine process (default: one engine takes OMP_NUM_THREADS or every core; pool workers and replicas split this host's cores)

    def __post_init__(self) -> None:
        _check_ray_knobs(self)
        if isinstance(self.limit_mm_per_prompt, str):
            object.__setattr__(self, "limit_mm_per_prompt", json.loads(self.limit_mm_per_prompt))
        self.compilation_dict()  # (refuses unknown keys and bad values here, once)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if not self.tenant_step_share >= 0:
            raise ValueError("tenant_step_share must be >= 0 (0: off)")
        if not self.max_grammar_step_ms >= 0:
            raise ValueError("max_grammar_step_ms must be >= 0 (0: auto)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.mm_encoder_tp_mode not in ("weights", "data"):
            raise ValueError(f"mm_encoder_tp_mode must be 'weights' or 'data', got {self.mm_encoder_tp_mode!r}")
        for name in ("data_parallel_size", "encode_workers", "prefill_workers", "decode_workers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer")
        for name in ("tensor_parallel_size", "encode_tensor_parallel_size",
                     "prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for pool in ("encode", "prefill", "decode"):
            if getattr(self, f"{pool}_tensor_parallel_size") is not None and \
                    not getattr(self, f"{pool}_workers"):
                raise ValueError(f"{pool}_tensor_parallel_size needs {pool}_workers > 0 (the "
                                 "colocated engine's ranks are tensor_parallel_size)")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if self.prefill_workers and not self.decode_workers:
            raise ValueError("prefill_workers needs decode_workers > 0 (the prefill pool hands "
                             "its KV to the decode pool)")
        if self.encode_workers and not self.decode_workers:
            raise ValueError("encode_workers needs decode_workers > 0 (use encode_workers=E, "
                             "decode_workers=D for E+PD, plus prefill_workers=P for E+P+D)")
        if self.decode_workers and self.data_parallel_size != 1:
            raise ValueError("data_parallel_size replicates the colocated engine; with pools, "
                             "size each pool instead (encode_workers, prefill_workers, "
                             "decode_workers)")
        if self.kv_transfer not in ("auto", "inproc", "shm", "tcp"):
            raise ValueError(f"kv_transfer must be auto, inproc, shm or tcp, got {self.kv_transfer!r}")
        if self.kv_transfer == "inproc" and (self.decode_workers or self.worker_address):
            # NOTE: every pool worker is its own process; inproc endpoints join one process
            # only (tests and tools that run handlers side by side make their own).
            raise ValueError("kv_transfer=inproc moves data inside one process, but pool "
                             "workers are separate processes: use auto, shm (one host) or tcp")
        if self.worker_address is not None:
            if not self.worker_address.startswith("tcp://"):
                raise ValueError("worker_address must be tcp://HOST:PORT")
            if not self.worker_keys:
                raise ValueError("worker_address needs worker_keys: workers on other hosts "
                                 "register over CURVE only (make keys with `triptych keys`)")
            if not self.decode_workers:
                raise ValueError("workers on other hosts join pools: set decode_workers (and "
                                 "prefill_workers / encode_workers) for the layout")
        if not self.worker_heartbeat_timeout >= 2.0:  # NOTE: also refuses NaN
            raise ValueError("worker_heartbeat_timeout must be at least 2 seconds (workers "
                             "heartbeat every 0.5 s)")
        for name in ("max_step_seconds", "first_token_timeout"):
            v = getattr(self, name)
            if not (v == 0 or v >= 1.0):  # NOTE: also refuses NaN
                raise ValueError(f"{name} must be 0 (off) or at least 1 second, got {v!r}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError("kv_transfer_timeout must be positive")
        if self.mm_preprocessor not in ("fast", "hf"):
            raise ValueError(f"mm_preprocessor must be 'fast' or 'hf', got {self.mm_preprocessor!r}")
        if self.mm_processor_cache_type not in ("lru", "shm"):
            raise ValueError(f"mm_processor_cache_type must be 'lru' or 'shm', got {self.mm_processor_cache_type!r}")
        for name in ("gpu_memory_utilization", "encode_gpu_memory_utilization",
                     "prefill_gpu_memory_utilization", "decode_gpu_memory_utilization"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:  # NOTE: also refuses NaN
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
            pool = name.removesuffix("_gpu_memory_utilization")
            if v is not None and pool != name and not getattr(self, f"{pool}_workers"):
                raise ValueError(f"{name} needs {pool}_workers > 0 (one engine takes "
                                 "gpu_memory_utilization)")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if not 0 <= self.mm_processor_cache_gb < float("inf"):  # NOTE: also refuses NaN
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb!r}")
        if parse_size(self.encoder_cache_size) < 0:
            raise ValueError(f"encoder_cache_size must be >= 0, got {self.encoder_cache_size!r}")
        if self.cpu_gemm not in ("onednn", "torch"):
            raise ValueError(f"cpu_gemm must be onednn or torch, got {self.cpu_gemm!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 (or unset), got {self.quantization!r}")
        if self.quantization and self.cpu_gemm != "onednn":
            raise ValueError("quantization=int8 runs on the packed CPU GEMMs: leave cpu_gemm "
                             "at onednn")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int)
                                             or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        for k, v in self.limit_mm_per_prompt.items():
            if k not in ("image", "video") or not isinstance(v, int) or v < 0:
                raise ValueError(f"limit_mm_per_prompt: bad entry {k!r}: {v!r}")

    def compilation_dict(self) -> dict[str, Any]:
        """``compilation_config`` as a dict (JSON text parsed), with the flag
        ``max_cudagraph_capture_size`` folded in. ValueError for keys this engine lacks."""
        cc = self.compilation_config
        if isinstance(cc, str):
            try:
                cc = json.loads(cc)
            except ValueError:
                cc = None
            if not isinstance(cc, dict):
                raise ValueError("compilation_config must be a JSON object such as "
                                 '\'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\'')
        cc = dict(cc or {})
        unknown = sorted(set(cc) - COMPILATION_KEYS)
        if unknown:
            raise ValueError(f"compilation_config: unknown key(s) {unknown}; this engine "
                             f"takes {sorted(COMPILATION_KEYS)}")
        if self.max_cudagraph_capture_size is not None:
            cc["max_cudagraph_capture_size"] = self.max_cudagraph_capture_size
        sizes = cc.get("cudagraph_capture_sizes")
        if sizes is not None and (not isinstance(sizes, list) or not sizes or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)):
            raise ValueError("compilation_config.cudagraph_capture_sizes must be a list of "
                             f"positive batch sizes, got {sizes!r}")
        cap = cc.get("max_cudagraph_capture_size")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"max_cudagraph_capture_size must be a positive integer, got {cap!r}")
        return cc

    def pool_tensor_parallel_size(self, pool: str) -> int:
        """Ranks of each worker of ``pool`` (colocated | encode | prefill | decode)."""
        own = None if pool == "colocated" else getattr(self, f"{pool}_tensor_parallel_size")
        return own or self.tensor_parallel_size

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        for alias, name in ALIASES.items():  # vLLM's spellings
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"give {name} or {alias}, not both")
                kwargs[name] = kwargs.pop(alias)
        unknown = set(kwargs) - set(cls.field_names())
        if unknown:
            raise TypeError(f"unknown engine option(s): {sorted(unknown)}")
        return cls(**kwargs)
