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

import logging
from typing import Any

import torch
from triptych.config import EngineConfig
from triptych.engine.encoder_cache import EncoderCache
from triptych.engine.encoder_runner import EncoderRunner
from triptych.engine.engine_core import EngineCore
from triptych.engine.loaded_model import LoadedModel
from triptych.engine.model_runner import ModelRunner
from triptych.engine.model_shape import (
    ModelShape,
    check_batch_budget,
    num_kv_blocks,
    resolve_cpu_weights,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from triptych.models.weight_parts import parts_for_pool, weight_bytes
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
        if role == "engine":
            loaded.runner, loaded.num_blocks = _model_runner(config, loaded, group, backend)
    except BaseException:
        if group is not None:
            group.close()
        raise
    return loaded


def read_checkpoint(config: EngineConfig, device: torch.device
                    ) -> tuple[Any, torch.dtype, str, ModelShape]:
    """The checkpoint's HF config, and the dtype, attention backend and shape it resolves
    to on ``device`` (every rank of a group reads the same). A model whose CPU linear
    layers pack their weights computes in fp32 (``resolve_cpu_weights``)."""
    from transformers import AutoConfig
    from triptych.kernels import resolve_backend

    hf = AutoConfig.from_pretrained(config.model, local_files_only=True)
    dtype = torch.float32 if resolve_cpu_weights(config, device) else \
        resolve_dtype(config.dtype, device, getattr(hf, "dtype", None))
    backend = resolve_backend(config.attention_backend, device.type)
    return hf, dtype, backend, ModelShape.from_hf(hf)


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
                  backend: str) -> tuple[ModelRunner, int]:
    """Rank 0's runner and the group's agreed number of KV blocks."""
    from triptych.kernels import get_ops
    from triptych.models.tp_plan import local_kv_heads

    tp = config.tensor_parallel_size
    num_blocks = num_kv_blocks(config, m.shape, m.dtype, m.device, tp)
    if group is not None:
        num_blocks = group.ctx.min_int(num_blocks)  # every rank holds the same blocks
    kw: dict[str, Any] = {
        "num_blocks": num_blocks, "block_size": config.block_size,
        "num_layers": m.shape.num_layers, "head_dim": m.shape.head_dim,
        "dtype": m.dtype, "device": m.device, "ops": get_ops(backend), "seed": config.seed,
        "num_kv_heads": local_kv_heads(m.shape.num_kv_heads, tp)}
    if group is None:
        return ModelRunner(m.model, m.encoder, **kw), num_blocks
    return TPModelRunner(group, m.model, m.encoder, num_kv_heads_total=m.shape.num_kv_heads,
                         **kw), num_blocks
