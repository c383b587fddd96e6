"""Qwen2-VL and Qwen2.5-VL for the paged engine: vision tower + Qwen2 decoder with M-RoPE.

The language model runs on a flat batch of tokens from many sequences; attention reads the
batch layout (slot mapping, block tables, cu_seqlens) from the forward context. Both
architectures share the decoder; only the vision tower differs.

Parameter names (what ``load_weights`` expects after mapping checkpoint names):
    visual.*                    vision tower (see vision.py)
    language_model.embed_tokens / layers.N.* / norm
    lm_head.weight              absent when tie_word_embeddings
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from triptych.kernels import get_ops
from triptych.models.attention import PagedAttention
from triptych.models.checkpoint_names import hub_name, map_checkpoint_name, read_piece
from triptych.models.contract import write_vision_rows
from triptych.models.meta_build import on_meta
from triptych.models.parallel_layers import FusedLinear, Shard
from triptych.models.vision import Qwen2VisionTransformer, Qwen25VisionTransformer, host_grid
from triptych.models.weight_parts import check_parts, holds

if TYPE_CHECKING:  # the type only: models stand below parallel/
    from triptych.parallel.context import TPContext

logger = logging.getLogger("triptych.models")


def rope_config(text: Any) -> tuple[float, list[int]]:
    """(rope_theta, mrope_section) from a text config (transformers 5 keeps both in
    ``rope_parameters``; older configs had ``rope_scaling`` + ``rope_theta``)."""
    rp = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only default M-RoPE)")
    theta = rp.get("rope_theta", getattr(text, "rope_theta", 1000000.0))
    section = list(rp.get("mrope_section", [16, 24, 24]))  # HF's default when absent
    return float(theta), section


def text_head_dim(text: Any) -> int:
    """The language model's attention head size: ``hidden_size / num_attention_heads``.

    The one source of the value for the model's attention, its rotary tables and the KV
    cache. NOTE: HF's Qwen2-VL / Qwen2.5-VL attention derives it from hidden_size and
    ignores a ``head_dim`` in the config, while HF's rotary embedding would read one: a
    checkpoint whose ``head_dim`` disagrees has weights of the derived size and cannot run
    in HF either, so it is refused here rather than run with mismatched shapes."""
    heads = text.num_attention_heads
    if text.hidden_size % heads:
        raise ValueError(f"hidden_size {text.hidden_size} is not a multiple of "
                         f"num_attention_heads {heads}")
    derived = text.hidden_size // heads
    given = getattr(text, "head_dim", None)
    if given is not None and given != derived:
        raise ValueError(f"the checkpoint's head_dim ({given}) differs from hidden_size / "
                         f"num_attention_heads ({derived}), which Qwen2-VL's attention uses "
                         "(HF transformers cannot run such a checkpoint either)")
    return derived


class Qwen2Attention(nn.Module):
    """Self-attention with one fused q|k|v projection (the checkpoint's three are stacked
    by rows at load, see ``FusedLinear``): one GEMM instead of three per layer."""

    def __init__(self, text: Any, layer_idx: int, ops: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim = text_head_dim(text)
        h, d = text.hidden_size, self.head_dim
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = FusedLinear.single(
            h, list(zip(("q_proj", "k_proj", "v_proj"), self.sizes)), bias=True)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.attn = PagedAttention(layer_idx, self.num_heads, self.num_kv_heads, d, d ** -0.5)
        self.ops = ops

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                mrope_section: list[int], rope: Any = None) -> torch.Tensor:
        # x: [T, hidden]; positions: [3, T]; qkv: [T, (H + 2*Hkv) * D]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        extra = {} if rope is None else {"plan": rope}
        q, k = self.ops.apply_mrope(q, k, positions, cos_sin_cache, mrope_section, **extra)
        o = self.attn(q, k, v)  # [T, H, D]
        return self.o_proj(o.reshape(t, -1))


class Qwen2MLP(nn.Module):
    """SwiGLU with gate and up fused into one [2 * inter, hidden] projection; the
    activation silu(gate) * up is ``ops.silu_and_mul`` (one fused op on the CPU)."""

    def __init__(self, hidden: int, inter: int, ops: Any) -> None:
        super().__init__()
        self.inter, self.ops = inter, ops
        self.gate_up_proj = FusedLinear.single(
            hidden, [("gate_proj", inter), ("up_proj", inter)], bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate|up [T, 2 * inter] -> [T, inter] -> [T, hidden]
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x), self.inter))


class RMSNorm(nn.Module):
    """Weight holder; the op (optionally fused with the residual add) comes from ``ops``."""

    def __init__(self, dim: int, eps: float, ops: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, text: Any, layer_idx: int, ops: Any) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(text, layer_idx, ops)
        self.mlp = Qwen2MLP(text.hidden_size, text.intermediate_size, ops)
        self.input_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin_cache: torch.Tensor, mrope_section: list[int], rope: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # Residual stream carried separately so each norm fuses the preceding add.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin_cache, mrope_section, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen2TextModel(nn.Module):
    def __init__(self, text: Any, ops: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen2DecoderLayer(text, i, ops) for i in range(text.num_hidden_layers)])
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps, ops)
        self.ops = ops

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                mrope_section: list[int]) -> torch.Tensor:
        # M-RoPE cos/sin depend only on the positions: built once here, not in every layer
        # (for kernels that take them; a fused Triton rope reads the table itself).
        make = getattr(self.ops.apply_mrope, "make_plan", None)
        rope = None if make is None else make(positions, cos_sin_cache, mrope_section)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, cos_sin_cache, mrope_section, rope)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


_VISION = {"qwen2_vl": Qwen2VisionTransformer, "qwen2_5_vl": Qwen25VisionTransformer}


class Qwen2VLForCausalLM(nn.Module):
    """Qwen2-VL / Qwen2.5-VL (picked by ``config.model_type``) on flat token batches.

    With ``tp`` (a rank of a tensor-parallel group) the layers are swapped for their
    sharded forms before any memory is allocated (models/tp_plan.py); ``shard_vision``
    False keeps the whole vision tower on every rank (mm_encoder_tp_mode="data")."""

    # Both towers encode any subset of a batch's items alone (attention never crosses an
    # item), so their ranks can split a batch of images (mm_encoder_tp_mode="data").
    supports_encoder_data_parallel = True
    # A CUDA graph may hold the decode forward: it reads nothing back from the device
    # (tests/test_host_syncs.py). ``cuda_graph_blocker`` says why not where it is False.
    supports_cuda_graphs = True
    cuda_graph_blocker = ""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 attention_backend: str = "torch", tp: TPContext | None = None,
                 shard_vision: bool = True, parts: str = "all") -> None:
        super().__init__()
        self.parts = check_parts(parts)  # which submodules this process builds and loads
        if config.model_type not in _VISION:
            raise ValueError(f"model_type {config.model_type!r} is not one of {sorted(_VISION)}")
        text = getattr(config, "text_config", None) or config
        if getattr(text, "use_sliding_window", False):
            logger.warning("use_sliding_window is set; like HF's sdpa path, it is ignored")
        self.config = config
        self.ops = get_ops(attention_backend)
        self.rope_theta, self.mrope_section = rope_config(text)
        self.head_dim = text_head_dim(text)
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 "
                             f"= {self.head_dim // 2}")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.pack_head = ""  # set by load_model(cpu_weights=...): the head's packed format
        self._head_gemm: Any = None  # CpuGemm: a packed copy of the head, made on first use
        # Build on the meta device: no random init, no fp32 copy of a big model on the host.
        with on_meta():
            if parts != "language":
                self.visual = _VISION[config.model_type](config.vision_config, attention_backend)
            if parts != "vision":
                self.language_model = Qwen2TextModel(text, self.ops)
                if not self.tie_word_embeddings:
                    self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        if tp is not None and tp.size > 1:
            from triptych.models.tp_plan import shard_qwen2_vl
            shard_qwen2_vl(self, tp, shard_vision)
        self.to(dtype=dtype)
        self.to_empty(device=device)  # parameters are garbage until load_weights
        self.register_buffer("cos_sin_cache", self._rope_cache(text.max_position_embeddings,
                                                               device), persistent=False)

    def _rope_cache(self, max_pos: int, device: str) -> torch.Tensor:
        """[max_pos, head_dim] fp32: cos of position*inv_freq in [:D/2], sin in [D/2:].

        NOTE: M-RoPE ids can exceed the token index (Qwen2.5-VL spaces video frames by
        tokens_per_second * second_per_grid_t); an id >= max_position_embeddings is out of
        range here, so the engine must reject such prompts (position + delta < max_pos)."""
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)

    @property
    def spatial_merge_size(self) -> int:
        return self.config.vision_config.spatial_merge_size

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return self.language_model.embed_tokens(input_ids)

    def merge_vision(self, embeds: torch.Tensor, spans: list[tuple[int, torch.Tensor]]
                     ) -> dict[str, Any]:
        """Write the items' embedding rows over their placeholders (the payload is the
        embedding alone: nothing else for ``forward``)."""
        write_vision_rows(embeds, spans)
        return {}

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flat batch; positions [3, T] int64.

        Must run inside ``forward_context`` (attention reads the batch layout from it)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return self.language_model(positions, x, self.cos_sin_cache, self.mrope_section)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (sharded: this rank's vocab slice; the runner
        gathers the slices)."""
        w = (self.language_model.embed_tokens.weight if self.tie_word_embeddings
             else self.lm_head.weight)
        # (set only for a CPU engine's packed weights: engine/device/platform.py)
        if self.pack_head:
            # The head is the widest GEMM of a decode step (vocab ~152k): a packed copy of
            # the frozen weight (kernels/cpu/linear.py; the embedding keeps its own).
            if self._head_gemm is None:
                from triptych.kernels.cpu.linear import CpuGemm

                self._head_gemm = CpuGemm(w, None, self.pack_head)
            return self._head_gemm(hidden)
        return F.linear(hidden, w).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of ``compute_logits(hidden)`` per row, [N] int64, without making the
        logits, where the packed head can (CPU fp32 panels); else None (the runner then
        asks for the logits)."""
        if not self.pack_head:
            return None
        if self._head_gemm is None:
            self.compute_logits(hidden[:1])  # packs the head once
        return self._head_gemm.argmax(hidden)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                      ) -> list[torch.Tensor]:
        """Encoder payloads, one [t*h*w / merge**2, payload width] tensor per item."""
        if self.parts == "language":
            raise ValueError("this worker loaded the language model only (no vision tower): "
                             "its images must come encoded from the encode pool")
        grid = host_grid(grid_thw)  # (the engine's grid is a host array already)
        emb = self.visual(pixel_values, grid)
        sizes = (grid.prod(-1) // self.spatial_merge_size ** 2).tolist()
        return list(emb.split(sizes))

    def shard_table(self) -> dict[str, list[Shard]]:
        """Our (unfused) checkpoint name -> the pieces this rank loads from it. Layers that
        fuse or shard say so (``shards``); every other parameter is read whole."""
        table: dict[str, list[Shard]] = {}
        for prefix, mod in self.named_modules():
            if hasattr(mod, "shards"):
                table.update(mod.shards(prefix))
        targets = {sh.param for pieces in table.values() for sh in pieces}
        for name, _ in self.named_parameters():
            if name not in targets:
                table[name] = [Shard(name)]
        return table

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy checkpoint tensors in by name (hub layout or transformers-5 layout).

        ``weights`` yields (name, tensor) or (name, lazy slice: ``shape`` + ``read(dim,
        start, end)``, see loader.LazyTensor): a sharded rank then reads only its slices.
        Raises ValueError on a shape mismatch or when a parameter stays unloaded."""
        params = dict(self.named_parameters())
        table = self.shard_table()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for ckpt_name, tensor in weights:
            name = map_checkpoint_name(ckpt_name)
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding serves as the head
            if name is not None and not holds(self.parts, name):
                continue  # a part this process does not run: never read
            pieces = table.get(name) if name is not None else None
            if pieces is None:
                unexpected.append(ckpt_name)
                continue
            for sh in pieces:
                param = params[sh.param]
                if sh.rows is not None:  # this checkpoint tensor's rows of the parameter
                    param = param.narrow(sh.dst_dim, sh.rows[0], sh.rows[1] - sh.rows[0])
                param.copy_(read_piece(ckpt_name, tensor, sh, tuple(param.shape)))
            loaded.add(name)
        missing = sorted(set(table) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs (hub "
                             f"names; transformers-5 saves use model.language_model./model.visual.)"
                             f": {', '.join(hub_name(n) for n in missing)}")
        if unexpected:
            logger.warning("ignored %d checkpoint tensor(s) the model does not use: %s",
                           len(unexpected), ", ".join(unexpected[:10]))
        return loaded
