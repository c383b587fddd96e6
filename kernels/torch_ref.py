"""Plain-torch reference implementations of every kernel in this folder.

These are the CPU runtime and the oracle the Triton kernels are tested against; each
function here has a Triton twin in the sibling modules with the same signature.

KV cache layout (one tensor pair per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's *slot* is ``block_id * block_size + offset_in_block``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = do not store (padding)
) -> None:
    """Scatter new keys/values into their cache slots, in place."""
    nb, bs, hkv, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid] if not bool(valid.all()) else slot_mapping
    if not bool(valid.all()):
        key, value = key[valid], value[valid]
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of one sequence, [seq_len, Hkv, D] each, gathered through its block table."""
    bs = k_cache.shape[1]
    nblk = (seq_len + bs - 1) // bs
    blocks = block_table[:nblk].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including the query token
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per sequence over its whole paged context (GQA aware)."""
    b, h, d = q.shape
    bs = k_cache.shape[1]
    if b == 0:
        return q.new_empty(b, h, d)
    max_len = int(seq_lens.max())
    nblk = (max_len + bs - 1) // bs
    blocks = block_tables[:, :nblk].long()  # [B, nblk]
    # Batched gather, then a strided view: [B, nblk*bs, Hkv, D] -> [B, Hkv, L, D]
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    pos = torch.arange(nblk * bs, device=q.device)
    mask = pos[None, :] < seq_lens[:, None].to(q.device)  # [B, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=True)  # [B, H, 1, D]
    return out[:, :, 0]


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: flattened query chunks of B sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32: query chunk boundaries in q
    seq_lens: torch.Tensor,  # [B] int32: context length including this chunk
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each query chunk over its cached prefix and itself.

    The chunk's own K/V must already be in the cache (``reshape_and_cache`` first).
    Query i of a chunk of length q_len sits at position ``seq_len - q_len + i``.
    """
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        s, e = cu[i], cu[i + 1]
        q_len = e - s
        if q_len == 0:
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[i], seq_len)
        qi = q[s:e].transpose(0, 1)  # [H, q_len, D]
        ki = k.transpose(0, 1).repeat_interleave(h // hkv, 0)  # [H, L, D]
        vi = v.transpose(0, 1).repeat_interleave(h // hkv, 0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0), ki.unsqueeze(0).to(qi.dtype), vi.unsqueeze(0).to(qi.dtype),
            attn_mask=mask, scale=scale,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [N+1] int32: segment boundaries
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Bidirectional attention inside each segment (vision patches of one image / window)."""
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),
            k[s:e].transpose(0, 1).unsqueeze(0),
            v[s:e].transpose(0, 1).unsqueeze(0),
            scale=scale,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32; with ``residual``, returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight.float() * y).to(x.dtype)
    return y if residual is None else (y, residual)


def apply_mrope(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [3, T] int64: (temporal, height, width) position ids
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
    mrope_section: list[int],  # sums to D/2: rotary dims taken from t, h, w positions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary embedding (Qwen2-VL), neox style (rotate halves).

    Frequency index j in [0, D/2) takes its position from section s(j):
        j:  | 0 .. sec0-1 | sec0 .. sec0+sec1-1 | ... |
        s:  |   temporal  |       height        | width |
    """
    d = q.shape[-1]
    cs = cos_sin_cache[positions]  # [3, T, D]
    cos, sin = cs[..., : d // 2], cs[..., d // 2:]
    sec = torch.repeat_interleave(
        torch.arange(3, device=q.device), torch.tensor(mrope_section, device=q.device)
    )  # [D/2]: which section each frequency reads
    idx = sec.view(1, 1, -1).expand(1, cos.shape[1], -1)
    cos = torch.gather(cos, 0, idx)[0]  # [T, D/2]
    sin = torch.gather(sin, 0, idx)[0]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)
