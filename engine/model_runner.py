"""ModelRunner: a SchedulerOutput in, sampled token ids out.

It owns the KV cache tensors and flattens the scheduled chunks into one batch:

    request:        r0 (decode)   r1 (prefill chunk 16..40)       r2 (decode)
    flat tokens:    [t]           [t t t ... t]  (24)             [t]
    cu_seqlens_q:   0, 1,                        25,              26
    seq_lens:       ctx0+1,                      40,              ctx2+1

Image placeholder rows of the flat batch are overwritten with vision embeddings taken
from the encoder runner (a chunk may cover only part of an image's span).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from triptych.encode.encoder_runner import EncoderRunner
from triptych.engine.forward_context import AttentionMetadata, ForwardContext, forward_context
from triptych.engine.request import Request
from triptych.engine.sampler import Sampler, SamplerOutput
from triptych.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: Any, encoder: EncoderRunner, *, num_blocks: int, block_size: int,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, ops: SimpleNamespace, seed: int = 0) -> None:
        self.model, self.encoder, self.ops = model, encoder, ops
        self.block_size, self.device, self.dtype = block_size, device, dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(num_layers)]
        self.sampler = Sampler(seed)

    def positions_for(self, req: Request, start: int, end: int) -> torch.Tensor:
        """[3, end-start] M-RoPE positions; tokens past the prompt are text (index + delta)."""
        p = req.num_prompt_tokens
        parts = []
        if start < p:
            parts.append(req.mrope_positions[:, start:min(end, p)])
        if end > p:
            t = torch.arange(max(start, p), end, dtype=torch.long) + req.mrope_delta
            parts.append(t.expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]
                ) -> tuple[dict[str, int], dict[str, dict[int, float] | None]]:
        bs = self.block_size
        ids, pos, slots, cu, seq_lens, tables = [], [], [], [0], [], []
        mm_rows: list[tuple[int, str, int, int]] = []  # (flat row, mm hash, item row start, n)
        needed = []
        sample_rows, sample_reqs = [], []
        for req, n in out.scheduled:
            s, e = req.num_computed_tokens, req.num_computed_tokens + n
            base = cu[-1]
            ids.extend(req.all_token_ids[s:e])
            pos.append(self.positions_for(req, s, e))
            bt = torch.tensor(block_ids[req.request_id], dtype=torch.long)
            tok = torch.arange(s, e)
            slots.append(bt[tok // bs] * bs + tok % bs)
            tables.append(bt)
            for it in req.mm_items:
                lo, hi = max(s, it.offset), min(e, it.end)
                if lo < hi:
                    needed.append(it)
                    mm_rows.append((base + lo - s, it.mm_hash, lo - it.offset, hi - lo))
            cu.append(base + n)
            seq_lens.append(e)
            if e == req.num_tokens:  # chunk reaches the end: its last logits pick a token
                sample_rows.append(base + n - 1)
                sample_reqs.append(req)

        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        embeds = self.model.embed_tokens(input_ids)
        if mm_rows:
            embs = self.encoder.get_embeddings(needed)
            for row, h, start, n in mm_rows:
                embeds[row:row + n] = embs[h][start:start + n].to(embeds.dtype)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=block_tables.to(dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(n for _, n in out.scheduled),
        )
        with forward_context(ForwardContext(meta, self.kv_caches, self.ops)):
            hidden = self.model(input_ids, torch.cat(pos, dim=1).to(dev), embeds)
        if not sample_reqs:
            return {}, {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        rids = [r.request_id for r in sample_reqs]
        res: SamplerOutput = self.sampler(logits.cpu(), rids,
                                          [r.sampling_params for r in sample_reqs])
        return dict(zip(rids, res.token_ids)), dict(zip(rids, res.logprobs))
