"""Qwen3-VL (dense) for the paged engine: Qwen3 decoder, interleaved M-RoPE, DeepStack.

What differs from Qwen2-VL (qwen2_vl.py), following HF's Qwen3VLForConditionalGeneration:

    attention    q_norm / k_norm (RMSNorm over head_dim, per head) before the rotary;
                 head_dim is the config's own (may differ from hidden / heads); no qkv bias
                 unless ``attention_bias``
    M-RoPE       interleaved: frequency j takes its position from axis
                     h if j % 3 == 1 and j < 3 * section[1]
                     w if j % 3 == 2 and j < 3 * section[2]
                     t otherwise
    DeepStack    the tower's payload carries k extra [rows, hidden] blocks; after decoder
                 layer i < k the hidden states at the image rows get block i added

The prompt's position ids (t, h, w per token) are Qwen2-VL's for images (mrope.py).
Loading, logits, the packed head and item splitting are inherited from Qwen2VLForCausalLM.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from triptych.engine.device.device_io import to_device
from triptych.kernels import get_ops, torch_ref
from triptych.models.attention import PagedAttention
from triptych.models.contract import write_vision_rows
from triptych.models.fused_moe import SparseMoeBlock
from triptych.models.meta_build import on_meta
from triptych.models.parallel_layers import FusedLinear
from triptych.models.qwen2_vl import Qwen2MLP, Qwen2VLForCausalLM, RMSNorm, rope_config
from triptych.models.qwen3_vl_vision import Qwen3VisionTransformer
from triptych.models.weight_parts import check_parts

if TYPE_CHECKING:
    from triptych.parallel.context import TPContext

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [T, 1, D] fp32, built once a forward


def interleaved_axes(mrope_section: list[int], half: int) -> torch.Tensor:
    """[half] int64: which position axis (0 t, 1 h, 2 w) each rotary frequency reads."""
    axis = torch.zeros(half, dtype=torch.long)
    for dim in (1, 2):
        axis[dim:mrope_section[dim] * 3:3] = dim
    return axis


def interleaved_rope_plan(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          axis: torch.Tensor) -> Rope:
    """(cos, sin) rows of a flat batch in torch_ref.apply_mrope's plan form."""
    d2 = cos_sin_cache.shape[-1] // 2
    pos = positions.gather(0, axis[:, None].expand(-1, positions.shape[1])).t()  # [T, D/2]
    freq = torch.arange(d2, device=positions.device)
    cos, sin = cos_sin_cache[pos, freq].float(), cos_sin_cache[pos, freq + d2].float()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


class Qwen3Attention(nn.Module):
    def __init__(self, text: Any, layer_idx: int, head_dim: int, ops: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim, d, h = head_dim, head_dim, text.hidden_size
        bias = bool(getattr(text, "attention_bias", False))
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = FusedLinear.single(
            h, list(zip(("q_proj", "k_proj", "v_proj"), self.sizes)), bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, text.rms_norm_eps, ops)
        self.k_norm = RMSNorm(d, text.rms_norm_eps, ops)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(-1, d)).view(t, self.num_heads, d)
        k = self.k_norm(k.reshape(-1, d)).view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        # NOTE: the reference op with a prebuilt plan: it ignores the (contiguous) sections,
        # so the interleaved layout lives entirely in the plan.
        q, k = torch_ref.apply_mrope(q, k, None, None, [], plan=rope)  # type: ignore[arg-type]
        return self.o_proj(self.attn(q, k, v).reshape(t, -1))


def is_sparse_layer(text: Any, layer_idx: int) -> bool:
    """Whether a layer's MLP is a mixture of experts (Qwen3-VL-MoE's rule: every
    ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``)."""
    n = getattr(text, "num_experts", 0) or 0
    return n > 0 and layer_idx not in (getattr(text, "mlp_only_layers", None) or []) and \
        (layer_idx + 1) % getattr(text, "decoder_sparse_step", 1) == 0


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, text: Any, layer_idx: int, head_dim: int, ops: Any) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(text, layer_idx, head_dim, ops)
        self.mlp: nn.Module = Qwen2MLP(text.hidden_size, text.intermediate_size, ops)
        if is_sparse_layer(text, layer_idx):
            self.mlp = SparseMoeBlock(text.hidden_size, text.moe_intermediate_size,
                                      text.num_experts, text.num_experts_per_tok, ops)
        self.input_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3TextModel(nn.Module):
    def __init__(self, text: Any, head_dim: int, ops: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(text, i, head_dim, ops)
                                     for i in range(text.num_hidden_layers)])
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, rope: Rope,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        rows, feats = deepstack if deepstack is not None else (None, None)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope)
            if feats is not None and i < feats.shape[0]:
                # HF adds after the layer's residual add: materialise the stream, add at
                # the image rows, and let the next norm start from it (same op order).
                h = x + residual
                h[rows] = h[rows] + feats[i].to(h.dtype)
                x, residual = h, None
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class _Transposed:
    """A stacked-experts checkpoint tensor stored [E, in, out] (the hub's layout), read as
    the [E, out, in] our parameter has (HF's loader transposes it the same way)."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        e, a, b = tuple(tensor.shape)
        self.shape = (e, b, a)

    def read(self, dim: int = 0, src: tuple[int, int] | None = None) -> torch.Tensor:
        whole = self.tensor if isinstance(self.tensor, torch.Tensor) else self.tensor.read()
        out = whole.transpose(1, 2).contiguous()
        return out if src is None else out.narrow(dim, src[0], src[1] - src[0])


def _experts_as_params(weights: Iterable[tuple[str, Any]], params: Iterable[tuple[str, Any]]
                       ) -> Iterable[tuple[str, Any]]:
    """Pass checkpoint tensors on, transposing stacked experts whose two last dims are
    swapped relative to the parameter (only when the shapes say so unambiguously)."""
    want = {name.rsplit("layers.", 1)[-1]: tuple(p.shape) for name, p in params
            if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for name, tensor in weights:
        shape = tuple(tensor.shape)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and len(shape) == 3:
            w = want.get(name.rsplit("layers.", 1)[-1])
            if w is not None and shape != w and (shape[0], shape[2], shape[1]) == w:
                tensor = _Transposed(tensor)
        yield name, tensor


class Qwen3VLForCausalLM(Qwen2VLForCausalLM):
    """Qwen3-VL dense and MoE (experts by config) on flat token batches; with ``tp`` the
    layers are swapped for rank shards (models/tp_plan.py; experts: fused_moe.ShardedMoeBlock)."""

    supports_encoder_data_parallel = True

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 attention_backend: str = "torch", tp: TPContext | None = None,
                 shard_vision: bool = True, parts: str = "all") -> None:
        nn.Module.__init__(self)
        self.parts = check_parts(parts)
        text = config.text_config
        self.config = config
        self.ops = get_ops(attention_backend)
        self.rope_theta, self.mrope_section = rope_config(text)
        self.head_dim = text.head_dim
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 "
                             f"= {self.head_dim // 2}")
        self.hidden = text.hidden_size
        self.num_deepstack = len(config.vision_config.deepstack_visual_indexes)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.pack_head = ""
        self._head_gemm: Any = None
        with on_meta():
            if parts != "language":
                self.visual = Qwen3VisionTransformer(config.vision_config, attention_backend)
            if parts != "vision":
                self.language_model = Qwen3TextModel(text, self.head_dim, self.ops)
                if not self.tie_word_embeddings:
                    self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if tp is not None and tp.size > 1:
            from triptych.models.tp_plan import shard_qwen2_vl  # the same plan fits

            shard_qwen2_vl(self, tp, shard_vision)
        self.to(dtype=dtype)
        self.to_empty(device=device)
        self.register_buffer("cos_sin_cache", self._rope_cache(text.max_position_embeddings,
                                                               device), persistent=False)
        self.register_buffer("rope_axis", interleaved_axes(
            self.mrope_section, self.head_dim // 2).to(device), persistent=False)

    @property
    def supports_cuda_graphs(self) -> bool:  # type: ignore[override]
        return not self.cuda_graph_blocker

    @property
    def cuda_graph_blocker(self) -> str:  # type: ignore[override]
        """Why a CUDA graph cannot hold the decode forward ("" when it can): MoE experts
        that read their per-expert counts back (no sync-free grouped GEMM for this dtype
        and device, models/fused_moe.py)."""
        lm = getattr(self, "language_model", None)
        moe = [layer.mlp for layer in lm.layers if isinstance(layer.mlp, SparseMoeBlock)] \
            if lm is not None else []
        if not any(block.reads_back for block in moe):
            return ""
        w = moe[0].experts.down_proj
        return (f"the MoE experts read their per-expert token counts back every layer (no "
                f"sync-free grouped GEMM for {w.dtype} on {w.device}: torch._grouped_mm "
                "with the triton backend, bf16 on sm90/sm100)")

    def merge_vision(self, embeds: torch.Tensor, spans: list[tuple[int, torch.Tensor]]
                     ) -> dict[str, Any]:
        """Embedding columns over the placeholders; the DeepStack blocks of the same rows
        go to ``forward`` as (flat rows [N], features [k, N, hidden])."""
        write_vision_rows(embeds, spans)
        if not self.num_deepstack or not spans:
            return {}
        dev = embeds.device
        rows = to_device(torch.cat([torch.arange(r, r + p.shape[0]) for r, p in spans]), dev)
        feats = torch.cat([to_device(p[:, self.hidden:], dev) for _, p in spans])
        feats = feats.view(-1, self.num_deepstack, self.hidden).transpose(0, 1)
        return {"deepstack": (rows, feats)}

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = interleaved_rope_plan(positions, self.cos_sin_cache, self.rope_axis)
        return self.language_model(x, rope, deepstack)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        try:
            return super().load_weights(_experts_as_params(weights, self.named_parameters()))
        except ValueError as e:
            if "deepstack_merger_list" in str(e):
                idx = list(self.config.vision_config.deepstack_visual_indexes)
                raise ValueError(f"the checkpoint lacks Qwen3-VL's DeepStack mergers "
                                 f"(visual.deepstack_merger_list.*) for deepstack_visual_"
                                 f"indexes {idx}: {e}") from None
            raise
