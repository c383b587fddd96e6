"""load_for_role: the model a worker process runs, in one process or as rank 0 of a group.

    load_for_role(config, "engine")  model + KV cache runner + encoder: EngineCore's
    load_for_role(config, "encode")  model + encoder only: the encode worker's
    load_engine_core(config, ...)    an EngineCore on the engine role's (workers, LLMEngine)

    read the checkpoint's config once -> device, dtype, attention backend, ModelShape
    the parts this worker runs (weight_parts_for): the tower, the language model or both
    tensor_parallel_size > 1: start ranks 1..N-1 (parallel/group.py), this process is rank 0
    load rank 0's weights -> EncoderRunner (TPEncoder in a group) -> ModelRunner (TPModelRunner)

The other ranks load their shard of the same parts in ``parallel/rank.py`` (the parts
travel in their start-up message) and report the bytes they hold. The engine receives what is built
here (``engine/loaded_model.py``), so ``engine/`` stands below ``parallel/``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from triptych.config import EngineConfig, parse_size
from triptych.engine.encoder.encoder_cache import EncoderCache
from triptych.engine.encoder.encoder_runner import EncoderRunner
from triptych.engine.device.cuda_graphs import GraphPlan, graph_plan
from triptych.engine.engine_core import EngineCore
from triptych.engine.loaded_model import LoadedModel
from triptych.engine.sizing.memory import (
    encode_share,
    gib,
    kv_blocks_from_share,
    release_device_memory,
    share_flag,
    start_snapshot,
)
from triptych.engine.runner.model_runner import ModelRunner
from triptych.engine.sizing.model_shape import (
    ModelShape,
    check_batch_budget,
    kv_block_bytes,
    num_kv_blocks,
    resolve_cpu_weights,
    resolve_device,
    resolve_max_model_len,
)
from triptych.engine.sizing.profile_run import (
    ProfileMeter,
    largest_image,
    max_image_tokens,
    profile_blocks,
    profile_step,
    run_encoder_profile,
    run_profile,
)
from triptych.engine.request import MMItem
from triptych.engine.runner.warmup import warm_up
from triptych.models.weight_parts import parts_for_pool, weight_bytes
from triptych.parallel import wire as tp_wire
from triptych.parallel.group import TPGroup, start_group
from triptych.parallel.runner import TPEncoder, TPModelRunner

ROLES = ("engine", "encode")
logger = logging.getLogger("triptych.loader")


def weight_parts_for(config: EngineConfig, role: str, pool: str = "") -> str:
    """Which parts of the model a worker runs (models/weight_parts.py): an encode worker
    the tower; a prefill or decode worker of a layout with an encode pool the language
    model (its images arrive encoded); everyone else (colocated, P+D, LLM) both. A
    tensor-parallel group loads the same parts on every rank (each its shard of them)."""
    return "vision" if role == "encode" else parts_for_pool(pool, config.encode_workers)


def load_for_role(config: EngineConfig, role: str, data_kind: str = "",
                  key_name: str | None = None, pool: str = "") -> LoadedModel:
    """Load ``config.model`` for ``role`` (engine | encode) in ``pool`` (the worker's, or
    "" outside a pool layout): only the parts that role runs there (``weight_parts_for``).
    ``data_kind`` / ``key_name``: a pool worker's transport (and CURVE key) for its ranks'
    KV endpoints (rank to rank between groups). Raises ValueError for knobs the checkpoint
    cannot take, before any process starts or weight loads."""
    from triptych.models import load_model

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    device = resolve_device(config.device)
    start = start_snapshot(config, role, pool, device)  # CUDA: refuses a share not free
    hf, dtype, backend, shape = read_checkpoint(config, device)
    max_model_len = resolve_max_model_len(config, shape.max_position_embeddings)
    if role == "engine":
        check_batch_budget(config, max_model_len)
    parts = weight_parts_for(config, role, pool)
    # tensor_parallel_size > 1: this process is rank 0 of a group it starts here
    group = start_group(config, hf, role, device, data_kind, key_name, parts)
    try:
        cpu_weights = resolve_cpu_weights(config, device)
        model, hf = load_model(config.model, dtype, str(device), backend,
                               tp=group.ctx if group else None,
                               shard_vision=group is None or group.encoder_mode == "weights",
                               cpu_weights=cpu_weights, parts=parts)
        held = weight_bytes(model)
        ranks = [held, *group.rank_weight_bytes()] if group is not None else [held]
        logger.info("%s%s weights: %s (vision %d bytes, language %d bytes%s)%s", role,
                    f" ({pool})" if pool else "", parts, held["vision"], held["language"],
                    "" if group is None else f"; ranks 0..{group.size - 1}: " + ", ".join(
                        f"vision {r['vision']} language {r['language']}" for r in ranks),
                    f"; linear layers packed in {cpu_weights} (--dtype / --quantization)"
                    if cpu_weights else "")
        encode_fn = model.encode_images if group is None else \
            TPEncoder(group, model, shape.payload_width, dtype)
        encoder = EncoderRunner(encode_fn, EncoderCache(config.encoder_cache_size), device,
                                dtype)
        loaded = LoadedModel(model, hf, shape, device, dtype, backend, max_model_len, encoder,
                             group=group, weight_parts=parts, weight_bytes=held,
                             rank_weight_bytes=ranks)
        meter = ProfileMeter(device, start) if start is not None else None
        if meter is not None:
            meter.loaded()
        if role == "engine":
            loaded.runner, loaded.num_blocks = _model_runner(config, loaded, group, backend,
                                                             meter, pool)
        elif meter is not None:
            loaded.gpu_memory_share = _encode_share(config, loaded, meter)
    except BaseException:
        if group is not None:
            group.close()
        raise
    return loaded


def read_checkpoint(config: EngineConfig, device: torch.device
                    ) -> tuple[Any, torch.dtype, str, ModelShape]:
    """The checkpoint's HF config, and the dtype, attention backend and shape it resolves
    to on ``device`` (every rank of a group reads the same): the device's choices are
    ``engine/device/platform.py``'s."""
    from transformers import AutoConfig
    from triptych.engine.device.platform import platform_for

    hf = AutoConfig.from_pretrained(config.model, local_files_only=True)
    platform = platform_for(config, device, getattr(hf, "dtype", None))
    return hf, platform.dtype, platform.attention_backend, ModelShape.from_hf(hf)


def load_engine_core(config: EngineConfig, eos_token_id: int | None = None,
                     data_kind: str = "", key_name: str | None = None,
                     pool: str = "") -> EngineCore:
    """An ``EngineCore`` on ``load_for_role(config, "engine", ..., pool)``; the ranks stop
    again if the core cannot be built."""
    loaded = load_for_role(config, "engine", data_kind, key_name, pool)
    try:
        return EngineCore(config, loaded, eos_token_id=eos_token_id)
    except BaseException:
        loaded.close()
        raise


def _model_runner(config: EngineConfig, m: LoadedModel, group: TPGroup | None,
                  backend: str, meter: ProfileMeter | None = None, pool: str = ""
                  ) -> tuple[ModelRunner, int]:
    """Rank 0's runner and the group's agreed number of KV blocks: from the knobs, or (CUDA,
    neither num_kv_blocks nor kv_cache_memory) by a profile run on a small cache, whose
    measurements size the real one (``size_by_profile``)."""
    from triptych.kernels import get_ops
    from triptych.models.tp_plan import local_kv_heads

    tp = config.tensor_parallel_size
    num_blocks = num_kv_blocks(config, m.shape, m.dtype, m.device, tp)
    profile = num_blocks is None
    if profile:
        num_blocks = profile_blocks(config)
    if group is not None:
        num_blocks = group.ctx.min_int(num_blocks)  # every rank holds the same blocks
    kw: dict[str, Any] = {
        "num_blocks": num_blocks, "block_size": config.block_size,
        "num_layers": m.shape.num_layers, "head_dim": m.shape.head_dim,
        "dtype": m.dtype, "device": m.device, "ops": get_ops(backend), "seed": config.seed,
        "num_kv_heads": local_kv_heads(m.shape.num_kv_heads, tp)}
    runner = ModelRunner(m.model, m.encoder, **kw) if group is None else TPModelRunner(
        group, m.model, m.encoder, num_kv_heads_total=m.shape.num_kv_heads, **kw)
    graphs = graph_plan(config, m.device, m.model, backend, tp)
    if m.device.type == "cuda" and not graphs.enabled:
        logger.info("decode steps run eagerly: %s", graphs.reason)
    if profile:
        assert meter is not None, "a profile run measures CUDA memory"
        num_blocks = size_by_profile(config, m, runner, group, meter, pool, graphs)
    if m.device.type == "cuda":  # the kernel variants of the first requests, compiled now
        warm_up(runner, num_blocks, config.block_size, m.max_model_len, text_token(m.shape))
    if graphs.enabled:  # over the real cache (the trial capture of the sizing was freed)
        runner.enable_cuda_graphs(graphs.sizes, m.max_model_len)
    return runner, num_blocks


def text_token(shape: ModelShape) -> int:
    """A token id that is neither an image nor a video placeholder (warm-up prompts)."""
    return next(t for t in range(3) if t not in (shape.image_token_id, shape.video_token_id))


def decodes_only(config: EngineConfig, pool: str) -> bool:
    """A decode worker beside a prefill pool: it imports its requests' KV and never runs
    the vision tower or fills an encoder cache (a preempted image request is handed back)."""
    return pool == "decode" and config.prefill_workers > 0


def _profile_image(config: EngineConfig, m: LoadedModel, pool: str = "") -> MMItem | None:
    """The largest image the limits allow, for a worker that runs the vision tower."""
    if m.weight_parts == "language" or config.limit_mm_per_prompt.get("image", 0) < 1 \
            or decodes_only(config, pool):
        return None
    return largest_image(config.model, m.hf_config, max_image_tokens(config, m.max_model_len))


def size_by_profile(config: EngineConfig, m: LoadedModel, runner: ModelRunner,
                     group: TPGroup | None, meter: ProfileMeter, pool: str,
                     graphs: GraphPlan | None = None) -> int:
    """One step at the limits on the small cache, then the real cache from the share: the
    KV blocks of this worker (the smallest any rank's share holds, in a group)."""
    from triptych.models.tp_plan import local_kv_heads

    step = profile_step(config, m.shape, m.hf_config, m.max_model_len,
                        _profile_image(config, m, pool))
    meter.begin()
    run_profile(runner, step)
    usage = meter.usage(0 if decodes_only(config, pool) else parse_size(config.encoder_cache_size))
    # NOTE: what the profile step's activations left in the caching allocator goes back to
    # the device before the KV cache is allocated (a worker sharing the GPU starts next)
    release_device_memory()
    if graphs is not None and graphs.enabled:  # a trial capture on the small cache: what
        # the graphs will hold comes out of the share, then they are freed again
        held = runner.enable_cuda_graphs(graphs.sizes, m.max_model_len)
        runner.disable_cuda_graphs()
        release_device_memory()
        usage = dataclasses.replace(usage, cuda_graphs=held)
    flag = share_flag(config, pool)
    requested = int(meter.start.total * config.gpu_memory_utilization)
    per_block = kv_block_bytes(m.shape, config.block_size, m.dtype,
                               local_kv_heads(m.shape.num_kv_heads, config.tensor_parallel_size))
    if group is None:
        n = kv_blocks_from_share(requested, usage, per_block, flag)
    else:  # NOTE: the ranks wait in min_int whatever rank 0 finds: join them, then refuse
        group.send(tp_wire.SizeKV())
        try:
            n, why = kv_blocks_from_share(requested, usage, per_block, flag), ""
        except ValueError as e:
            n, why = 0, str(e)
        n = group.ctx.min_int(n)
        if n < 2:
            raise ValueError(why or "a tensor-parallel rank's share leaves no room for a KV "
                                    f"cache (its log says why): raise {flag}")
    runner.allocate_kv_cache(n)
    logger.info("KV cache: %d blocks (%s) of a share of %s (%s %g): %s", n,
                gib(n * per_block), gib(requested), flag, config.gpu_memory_utilization,
                usage.describe())
    return n


def _encode_share(config: EngineConfig, m: LoadedModel, meter: ProfileMeter) -> float:
    """An encode worker's need, as a share of its device: the tower over the largest image,
    its weights and its encoder cache (ValueError when its own share is smaller)."""
    image = _profile_image(config, m)
    meter.begin()
    if image is not None:
        run_encoder_profile(m.encoder, image)
    usage = meter.usage(parse_size(config.encoder_cache_size))
    share = encode_share(usage, meter.start.total)
    given = config.encode_gpu_memory_utilization
    if given is not None and share > given:
        raise ValueError(f"an encode worker needs {share:g} of its GPU ({usage.describe()}), "
                         f"more than --encode-gpu-memory-utilization {given:g}: raise it")
    logger.info("encode worker needs %g of its GPU (%s)", share, usage.describe())
    return share
