"""Plain-torch reference implementations of every kernel in this folder.

These are the CPU runtime and the oracle the Triton kernels are tested against; each
function here has a Triton twin in the sibling modules with the same signature
(``silu_and_mul`` excepted: the Triton backend uses this one).

KV cache layout (one tensor pair per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's *slot* is ``block_id * block_size + offset_in_block``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


def cache_plan(slot_mapping: torch.Tensor, padded: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots to write, mask of valid rows or None when every row is valid): one check per
    forward instead of one in every layer. ``padded`` False (the host knows no slot is -1)
    skips the check, which reads the device."""
    if padded is False:
        return slot_mapping, None
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping, None
    return slot_mapping[valid], valid


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = do not store (padding)
    plan: tuple[torch.Tensor, torch.Tensor | None] | None = None,  # cache_plan(slot_mapping)
) -> None:
    """Scatter new keys/values into their cache slots, in place."""
    nb, bs, hkv, d = k_cache.shape
    slots, valid = plan if plan is not None else cache_plan(slot_mapping)
    if valid is not None:
        key, value = key[valid], value[valid]
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slots, key)
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slots, value)


reshape_and_cache.make_plan = cache_plan  # type: ignore[attr-defined]


class DecodePlan(NamedTuple):
    """What every layer's decode attention shares in one forward pass."""

    block_idx: torch.Tensor  # [B * nblk] int64: block ids, row by row (padding: block 0)
    num_blocks: int  # nblk: blocks per row, enough for the longest context
    mask: torch.Tensor  # [B, 1, 1, nblk * block_size] float: 0 inside the context, -inf past it


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                max_seq_len: int | None = None) -> DecodePlan:
    """``max_seq_len``: the longest context, from the host (None: read from ``seq_lens``)."""
    b = block_tables.shape[0]
    max_len = max_seq_len if max_seq_len is not None else int(seq_lens.max()) if b else 0
    nblk = (max_len + block_size - 1) // block_size
    pos = torch.arange(nblk * block_size, device=block_tables.device)
    past = pos[None, :] >= seq_lens[:, None].to(pos.device)  # [B, L]: beyond the context
    mask = torch.zeros(b, 1, 1, nblk * block_size, device=block_tables.device)
    mask.masked_fill_(past[:, None, None, :], float("-inf"))
    return DecodePlan(block_tables[:, :nblk].reshape(-1).long(), nblk, mask)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including the query token
    scale: float,
    plan: DecodePlan | None = None,  # per-forward gather indices and mask (decode_plan)
    max_seq_len: int | None = None,  # the longest context, known on the host
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per sequence over its whole paged context (GQA aware).

    The G = H / Hkv query heads sharing a KV head are the "query length" of one SDPA call
    per KV head, so K/V are gathered once and never repeated:
        q [B, H, D] -> [B, Hkv, G, D];  K, V [B, Hkv, L, D];  out [B, Hkv, G, D] -> [B, H, D]
    """
    b, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    if b == 0:
        return q.new_empty(b, h, d)
    if plan is None:
        plan = decode_plan(block_tables, seq_lens, bs, max_seq_len)
    length = plan.num_blocks * bs
    # One index_select of whole blocks on a flat view: [B*nblk, bs*Hkv*D] -> [B, Hkv, L, D]
    k = k_cache.view(nb, -1).index_select(0, plan.block_idx).view(b, length, hkv, d)
    v = v_cache.view(nb, -1).index_select(0, plan.block_idx).view(b, length, hkv, d)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    mask = plan.mask if plan.mask.dtype == q.dtype else plan.mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.view(b, hkv, h // hkv, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=scale)  # [B, Hkv, G, D]
    return out.reshape(b, h, d)


paged_decode_attention.make_plan = decode_plan  # type: ignore[attr-defined]


class PrefillGroup(NamedTuple):
    """Sequences of one prefill forward with the same (query length, context length)."""

    rows: torch.Tensor  # [n * q_len] int64: their query rows in the flat batch
    block_idx: torch.Tensor  # [n * nblk] int64: their blocks, sequence by sequence
    q_len: int
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool (cached prefix); None = plain causal


def prefill_plan(block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens: torch.Tensor, block_size: int,
                 cu_cpu: Any = None, lens_cpu: Any = None) -> list[PrefillGroup]:
    """Group the sequences by shape so each group is one batched SDPA call."""
    cu = (cu_cpu if cu_cpu is not None else cu_seqlens_q).tolist()
    lens = (lens_cpu if lens_cpu is not None else seq_lens).tolist()
    dev = block_tables.device
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, seq_len in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        if q_len:
            by_shape.setdefault((q_len, seq_len), []).append(i)
    groups = []
    for (q_len, seq_len), seqs in by_shape.items():
        nblk = (seq_len + block_size - 1) // block_size
        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs]).to(dev)
        block_idx = block_tables[seqs, :nblk].reshape(-1).long()
        mask = None
        if q_len != seq_len:  # a cached prefix: query i sits at seq_len - q_len + i
            q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
            mask = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]
        groups.append(PrefillGroup(rows, block_idx, q_len, seq_len, mask))
    return groups


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: flattened query chunks of B sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32: query chunk boundaries in q
    seq_lens: torch.Tensor,  # [B] int32: context length including this chunk
    scale: float,
    plan: list[PrefillGroup] | None = None,  # per-forward grouping (prefill_plan)
    max_query_len: int | None = None,  # unused here (the plan has the shapes): the Triton
    # twin's launch size
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each query chunk over its cached prefix and itself.

    The chunk's own K/V must already be in the cache (``reshape_and_cache`` first).
    Query i of a chunk of length q_len sits at position ``seq_len - q_len + i``.
    Sequences of equal shape run as one batch; a chunk with no cached prefix is plain
    causal SDPA (GQA without repeating K/V).
    """
    h, d = q.shape[1], q.shape[2]
    nb, bs, hkv, _ = k_cache.shape
    if plan is None:
        plan = prefill_plan(block_tables, cu_seqlens_q, seq_lens, bs)
    out = torch.empty_like(q)
    for g in plan:
        n = g.rows.numel() // g.q_len
        nblk = g.block_idx.numel() // n
        qg = q.index_select(0, g.rows).view(n, g.q_len, h, d).transpose(1, 2)
        k = k_cache.view(nb, -1).index_select(0, g.block_idx).view(n, nblk * bs, hkv, d)
        v = v_cache.view(nb, -1).index_select(0, g.block_idx).view(n, nblk * bs, hkv, d)
        k = k[:, :g.seq_len].transpose(1, 2).to(q.dtype)  # [n, Hkv, L, D]
        v = v[:, :g.seq_len].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, is_causal=g.mask is None,
                                           scale=scale, enable_gqa=True)  # [n, H, q_len, D]
        out.index_copy_(0, g.rows, o.transpose(1, 2).reshape(-1, h, d))
    return out


paged_prefill_attention.make_plan = prefill_plan  # type: ignore[attr-defined]


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [N+1] int32: segment boundaries
    scale: float,
    max_seqlen: int | None = None,  # unused here: the Triton twin's launch size
    cu_seqlens_cpu: Any = None,  # host copy of cu_seqlens (numpy or list: no device read)
) -> torch.Tensor:  # [T, H, D]
    """Bidirectional attention inside each segment (vision patches of one image / window).

    Runs of consecutive segments of equal length (the frames of same-sized images, the
    full windows of Qwen2.5-VL) are one batched SDPA call each."""
    out = torch.empty_like(q)
    cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    h, d = q.shape[1], q.shape[2]
    i = 0
    while i < len(cu) - 1:
        seg = cu[i + 1] - cu[i]
        j = i + 1
        while j < len(cu) - 1 and cu[j + 1] - cu[j] == seg:
            j += 1
        s, e = cu[i], cu[j]
        if seg:
            qs, ks, vs = (x[s:e].view(j - i, seg, h, d).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [n, H, seg, D]
            out[s:e] = o.transpose(1, 2).reshape(e - s, h, d)
        i = j
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
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # NOTE: torch's own rms_norm is bit-identical to the steps below in fp32 (checked in
        # tests/test_kernels.py) and issues a third of the ops.
        y = F.rms_norm(x, x.shape[-1:], weight, eps)
    else:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = (weight.float() * y).to(x.dtype)
    return y if residual is None else (y, residual)


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2 * inter]: gate in [:, :inter], up in [:, inter:]
    inter: int,
) -> torch.Tensor:
    """SwiGLU's activation, silu(gate) * up: [T, inter] (HF's ``act_fn(gate) * up``)."""
    if gate_up.shape[-1] != 2 * inter:
        raise ValueError(f"silu_and_mul: gate_up has {gate_up.shape[-1]} columns, "
                         f"not 2 * inter = {2 * inter}")
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


def mrope_plan(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               mrope_section: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D] fp32 of a flat batch: one gather per forward, not per layer.

    Frequency index j in [0, D/2) takes its position from section s(j):
        j:  | 0 .. sec0-1 | sec0 .. sec0+sec1-1 | ... |
        s:  |   temporal  |       height        | width |
    Returned as full-width rows, cos = [c | c] and sin = [-s | s], so that
    rope(x) = x * cos + roll(x, D/2) * sin  (roll swaps the halves: [x2 | x1]).
    """
    d2 = cos_sin_cache.shape[-1] // 2
    # NOTE: a Python list, not torch.repeat_interleave: torch's CPU kernel opens a parallel
    # region even for 3 repeats, and waiting for the woken thread cost 0.06-10 ms per
    # batch-1 step on the busy 2-core dev box (torch.profiler, three runs)
    sec = torch.tensor([s for s, n in enumerate(mrope_section) for _ in range(n)],
                       device=positions.device)  # [D/2]
    # position of every (token, frequency): [T, D/2], then one gather of cos|sin rows
    pos = positions.gather(0, sec[:, None].expand(-1, positions.shape[1])).t()
    freq = torch.arange(d2, device=positions.device)
    cos = cos_sin_cache[pos, freq].float()  # [T, D/2]
    sin = cos_sin_cache[pos, freq + d2].float()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def apply_mrope(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [3, T] int64: (temporal, height, width) position ids
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]
    mrope_section: list[int],  # sums to D/2: rotary dims taken from t, h, w positions
    plan: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) from mrope_plan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary embedding (Qwen2-VL), neox style (rotate halves), in fp32.

    x1 * c - x2 * s == x1 * c + x2 * (-s) exactly, so this equals HF's
    ``x * cos + rotate_half(x) * sin`` bit for bit in fp32."""
    cos, sin = plan if plan is not None else mrope_plan(positions, cos_sin_cache, mrope_section)
    d2 = q.shape[-1] // 2

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        y = xf * cos + xf.roll(d2, -1) * sin
        return y if y.dtype == x.dtype else y.to(x.dtype)

    return rot(q), rot(k)


apply_mrope.make_plan = mrope_plan  # type: ignore[attr-defined]
