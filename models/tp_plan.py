"""How Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense) split across tensor-parallel ranks, and which sizes can.

A transform on the freshly built (meta-device) model, before any memory is allocated:

    language model   embed_tokens -> vocab-parallel (the tied head then makes vocab slices)
                     qkv_proj, gate_up_proj -> column-parallel (each fused part sliced)
                     o_proj, down_proj -> row-parallel (one all-reduce each)
                     KV heads: Hkv / N per rank; fewer KV heads than ranks are replicated
                     (N / Hkv consecutive ranks hold the same head), as peers do
    vision tower     mm_encoder_tp_mode="weights": attention qkv / MLP up and the merger's
                     first layer column-parallel, their partners row-parallel;
                     "data": untouched (every rank holds the whole tower)

Norms, rotary tables and the patch embedding stay whole on every rank. A group that
loads one part of the model (models/weight_parts.py: an encode pool's the tower, a
prefill/decode pool's beside an encode pool the language model) builds and splits only
that part, on every rank, and only that part's sizes must divide.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from triptych.models.attention import PagedAttention
from triptych.models.meta_build import on_meta
from triptych.models.parallel_layers import (
    FusedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    rank_part,
)

if TYPE_CHECKING:  # the type only: models stand below parallel/
    from triptych.parallel.context import TPContext

logger = logging.getLogger("triptych.models")


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds (1 when heads are replicated across ranks)."""
    return max(1, num_kv_heads // size)


def _constraints(hf: Any, shard_vision: bool, parts: str = "all"
                 ) -> list[tuple[str, int, bool]]:
    """(name, size, may_replicate): sizes that tensor_parallel_size must divide (those of
    the ``parts`` a group loads)."""
    text = getattr(hf, "text_config", None) or hf
    out: list[tuple[str, int, bool]] = []
    if parts != "vision":
        out += [("num_attention_heads", text.num_attention_heads, False),
                ("num_key_value_heads", text.num_key_value_heads, True),
                ("intermediate_size", text.intermediate_size, False),
                ("vocab_size", text.vocab_size, False)]
        if getattr(text, "num_experts", 0):
            out.append(("moe_intermediate_size", text.moe_intermediate_size, False))
    if shard_vision and parts != "language":
        v = hf.vision_config
        if hf.model_type == "qwen2_vl":
            dim, mlp = v.embed_dim, int(v.embed_dim * v.mlp_ratio)
        else:
            dim, mlp = v.hidden_size, v.intermediate_size
        out += [("vision num_heads", v.num_heads, False),
                ("vision MLP width", mlp, False),
                ("vision merger width", dim * v.spatial_merge_size ** 2, False)]
    return out


def _fits(size: int, n: int, may_replicate: bool) -> bool:
    return n % size == 0 or (may_replicate and size % n == 0)


def check_tp_sizes(hf: Any, size: int, encoder_mode: str, parts: str = "all") -> None:
    """Raise ValueError (one line) when the model (the ``parts`` a group loads) cannot
    split ``size`` ways: it names the sizes that do not divide and the
    tensor_parallel_size values that work."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    from triptych.models.contract import contract_for

    if size > 1 and not contract_for(hf).supports_tensor_parallel:
        raise ValueError(f"{hf.model_type} has no tensor-parallel plan yet: use "
                         "tensor_parallel_size=1")
    shard_vision = encoder_mode == "weights" and contract_for(hf).shards_vision_weights
    cons = _constraints(hf, shard_vision=shard_vision, parts=parts)
    bad = [f"{name}={n}" for name, n, rep in cons if not _fits(size, n, rep)]
    if not bad:
        return
    works = [t for t in range(1, 65) if all(_fits(t, n, rep) for _, n, rep in cons)]
    hint = ""
    if any(b.startswith("vision") for b in bad):
        hint = "; or mm_encoder_tp_mode=data, which keeps the vision tower whole"
    raise ValueError(f"tensor_parallel_size={size} must divide {', '.join(bad)} (KV heads "
                     f"may instead divide it); sizes that work: {', '.join(map(str, works))}"
                     f"{hint}")


def resolve_encoder_mode(model_cls: type, requested: str, size: int) -> str:
    """The vision tower's mode: "data" only where the model can split a batch of items."""
    if requested == "data" and size > 1 and \
            not getattr(model_cls, "supports_encoder_data_parallel", False):
        logger.info("%s cannot split images across ranks; mm_encoder_tp_mode falls back to "
                    "weights", model_cls.__name__)
        return "weights"
    return requested


def shard_qwen2_vl(model: Any, ctx: TPContext, shard_vision: bool) -> None:
    """Swap the layers of a meta-device Qwen2VLForCausalLM for rank ``ctx.rank``'s shards:
    the parts the model was built with (``model.parts``, models/weight_parts.py) only."""
    text = getattr(model.config, "text_config", None) or model.config
    with on_meta():
        if shard_vision and model.parts != "language":
            _shard_vision(model.visual, ctx)
        if model.parts == "vision":
            return
        lm = model.language_model
        lm.embed_tokens = VocabParallelEmbedding(text.vocab_size, text.hidden_size, ctx)
        if not model.tie_word_embeddings:
            model.lm_head = FusedLinear(text.hidden_size, [rank_part(None, text.vocab_size, ctx)],
                                        bias=False)
        for layer in lm.layers:
            _shard_attention(layer.self_attn, text.hidden_size, ctx)
            mlp = layer.mlp
            if hasattr(mlp, "experts"):  # Qwen3-VL-MoE: each expert's intermediate dim split
                from triptych.models.fused_moe import ShardedMoeBlock

                layer.mlp = ShardedMoeBlock(text.hidden_size, text.moe_intermediate_size,
                                            text.num_experts, text.num_experts_per_tok,
                                            mlp.ops, ctx)
                continue
            mlp.gate_up_proj = FusedLinear(text.hidden_size, [
                rank_part("gate_proj", mlp.inter, ctx), rank_part("up_proj", mlp.inter, ctx)],
                bias=False)
            mlp.down_proj = RowParallelLinear(mlp.inter, text.hidden_size, False, ctx)
            mlp.inter //= ctx.size


def _shard_attention(a: Any, hidden: int, ctx: TPContext) -> None:
    h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
    replicas = max(1, ctx.size // hkv)
    a.num_heads, a.num_kv_heads = h // ctx.size, local_kv_heads(hkv, ctx.size)
    a.sizes = [a.num_heads * d, a.num_kv_heads * d, a.num_kv_heads * d]
    a.qkv_proj = FusedLinear(hidden, [
        rank_part("q_proj", h * d, ctx),
        rank_part("k_proj", hkv * d, ctx, replicas=replicas),
        rank_part("v_proj", hkv * d, ctx, replicas=replicas)], bias=a.qkv_proj.bias is not None)
    # Qwen3's q_norm / k_norm act per head on head_dim: whole on every rank
    a.o_proj = RowParallelLinear(h * d, hidden, a.o_proj.bias is not None, ctx)
    a.attn = PagedAttention(a.attn.layer_idx, a.num_heads, a.num_kv_heads, d, a.attn.scale)


def _column(linear: Any, ctx: TPContext) -> FusedLinear:
    return FusedLinear(linear.in_features, [rank_part(None, linear.out_features, ctx)],
                       bias=linear.bias is not None)


def _row(linear: Any, ctx: TPContext) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None,
                             ctx)


def _shard_vision(visual: Any, ctx: TPContext) -> None:
    for blk in visual.blocks:
        attn = blk.attn
        dim = attn.num_heads * attn.head_dim
        # the checkpoint's qkv is one [3 * dim, dim] tensor: q, k, v blocks of dim rows
        attn.qkv = FusedLinear(dim, [rank_part(None, dim, ctx, offset=i * dim, ckpt_rows=3 * dim)
                                     for i in range(3)], bias=True)
        attn.proj = _row(attn.proj, ctx)
        attn.num_heads //= ctx.size
        mlp = blk.mlp
        if hasattr(mlp, "fc1"):  # Qwen2-VL: quick_gelu MLP
            mlp.fc1, mlp.fc2 = _column(mlp.fc1, ctx), _row(mlp.fc2, ctx)
        elif hasattr(mlp, "linear_fc1"):  # Qwen3-VL
            mlp.linear_fc1, mlp.linear_fc2 = _column(mlp.linear_fc1, ctx), _row(mlp.linear_fc2, ctx)
        else:  # Qwen2.5-VL: SwiGLU
            mlp.gate_proj, mlp.up_proj = _column(mlp.gate_proj, ctx), _column(mlp.up_proj, ctx)
            mlp.down_proj = _row(mlp.down_proj, ctx)
    if hasattr(visual.merger, "mlp"):  # Qwen2-VL / Qwen2.5-VL
        merger = visual.merger.mlp
        merger[0], merger[2] = _column(merger[0], ctx), _row(merger[2], ctx)
        return
    # Qwen3-VL: the merger and each DeepStack merger (their norms stay whole)
    for m in [visual.merger, *visual.deepstack_merger_list]:
        m.linear_fc1, m.linear_fc2 = _column(m.linear_fc1, ctx), _row(m.linear_fc2, ctx)


def check_layout_tp(config: Any) -> None:
    """Every pool's tensor_parallel_size against the checkpoint (EngineConfig) and the
    parts its workers load, before any worker process starts: ValueError naming the sizes
    that do not divide. (The pools as router/layout.py makes them.)"""
    pools = [p for p in ("encode", "prefill", "decode") if getattr(config, f"{p}_workers")] \
        if config.decode_workers else ["colocated"]
    sizes = {p: config.pool_tensor_parallel_size(p) for p in pools}
    if all(t == 1 for t in sizes.values()):
        return
    from transformers import AutoConfig
    from triptych.models.registry import resolve_model_class
    from triptych.models.weight_parts import parts_for_pool

    hf = AutoConfig.from_pretrained(config.model, local_files_only=True)
    cls = resolve_model_class(getattr(hf, "architectures", None))
    for size, parts in sorted({(t, parts_for_pool(p, config.encode_workers))
                               for p, t in sizes.items()}):
        check_tp_sizes(hf, size, resolve_encoder_mode(cls, config.mm_encoder_tp_mode, size),
                       parts)
