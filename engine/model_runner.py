"""ModelRunner: a SchedulerOutput in, sampled token ids out.

It owns the KV cache tensors and a persistent ``InputBatch`` (engine/input_batch.py) that
holds each scheduled request's token ids, counters and block table across steps; a step
syncs the batch with the scheduler's decision (join, leave, new blocks), flattens it with
a few vectorised ops and runs the model once:

    request:        r0 (decode)   r1 (prefill chunk 16..40)       r2 (decode)
    flat tokens:    [t]           [t t t ... t]  (24)             [t]
    cu_seqlens_q:   0, 1,                        25,              26
    seq_lens:       ctx0+1,                      40,              ctx2+1

Rows follow the batch's order, not the scheduler's: outputs are keyed by request id.
Image placeholder rows of the flat batch are overwritten with vision embeddings taken
from the encoder runner (a chunk may cover only part of an image's span).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from triptych.engine.cuda_graphs import CudaGraphRunner
from triptych.engine.device_io import HostFetch, StepStaging, to_device, to_host
from triptych.engine.encoder_runner import EncoderRunner
from triptych.engine.forward_context import AttentionMetadata, ForwardContext, forward_context
from triptych.engine.grammar import apply_bitmask
from triptych.engine.input_batch import InputBatch, StepInputs
from triptych.engine.platform import sampler_argmax
from triptych.engine.request import MMItem
from triptych.engine.sampler import Argmax, Sampler, to_output
from triptych.engine.scheduler import SchedulerOutput


class RunnerBroken(Exception):
    """The runner's state cannot be trusted any more (e.g. a tensor-parallel group out of
    step): the engine must not retry the step per request; the worker stops instead.

    NOTE: not a RuntimeError, which callers catch to retry a request alone."""


class StepTimes:
    """Seconds spent per phase of ``execute`` (summed over steps; read by the profiler)."""

    PHASES = ("inputs", "vision", "forward", "logits", "sampling")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def add(self, marks: list[float]) -> None:
        for name, a, b in zip(self.PHASES, marks, marks[1:]):
            self.totals[name] += b - a
        self.steps += 1


@dataclass
class DeviceStep:
    """A step's inputs on the device (views of one staged copy) and the metadata that
    attention reads; ``extra``: the device copies of the extra host arrays staged with it."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [3, T] int64
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # [S + P] int64, None: every row, in order
    extra: list[torch.Tensor]
    graph_bucket: int | None = None  # the captured decode graph this step replays
    graph_partition: torch.Tensor | None = None  # [1] int32: its decode tokens per split


class GreedyIds:
    """run_model's answer when the LM head gave the step's greedy tokens directly (no
    logits: ``greedy_tokens`` of the model, a CPU fp32 head)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


class ModelRunner:
    # Plain-greedy steps may take their tokens from the model's ``greedy_tokens`` (the head's
    # argmax, no logits). A tensor-parallel runner gathers vocab slices of the logits, so
    # it turns this off.
    greedy_head = True

    def __init__(self, model: Any, encoder: EncoderRunner, *, num_blocks: int, block_size: int,
                 num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, ops: SimpleNamespace, seed: int = 0,
                 vocab_size: int = 0, argmax: Argmax | None = None) -> None:
        self.model, self.encoder, self.ops = model, encoder, ops
        self.block_size, self.device, self.dtype = block_size, device, dtype
        self._kv_layout = (num_layers, block_size, num_kv_heads, head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: CudaGraphRunner | None = None  # decode steps as CUDA graphs
        self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(seed, argmax or sampler_argmax(device))
        # the logits' width (every rank's slices together): the checkpoint's text vocab
        self.vocab_size = vocab_size or _text_config(model).vocab_size
        self.staging = StepStaging(device)  # one host -> device copy per step
        self.fetch = HostFetch(device)  # one device -> host copy per step
        self.kv_staging = StepStaging(device)  # KV import's pinned buffer (write_blocks)
        self.batch = InputBatch(block_size)
        self.times = StepTimes()  # cheap (5 clock reads a step); bench --profile reads it
        self.greedy_step = False  # this step's rows all plain greedy (execute sets it)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the paged KV cache with ``num_blocks`` blocks per layer, freeing the
        old one first (a profile run sizes the real cache after running on a small one).
        Only between steps: block ids held by requests refer to the old cache."""
        num_layers, block_size, num_kv_heads, head_dim = self._kv_layout
        self.disable_cuda_graphs()  # (captured over the old cache's addresses)
        self.kv_caches = []  # NOTE: drop the old tensors before allocating the new ones
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(num_layers)]

    def _sync(self, out: SchedulerOutput) -> np.ndarray:
        """Make the batch hold exactly this step's requests; returns tokens per row.

        A row is rewritten when its request is new, is another object under a reused id,
        or its counters disagree with the scheduler's (preempted and resumed, imported
        with KV, tokens added from outside): the request object is the truth.
        """
        batch = self.batch
        scheduled = {r.request_id for r, _ in out.scheduled}
        for rid in [rid for rid in batch.index if rid not in scheduled]:
            batch.remove(rid)  # finished, aborted, preempted, or not scheduled this step
        for req, _ in out.scheduled:
            rid = req.request_id
            row = batch.index.get(rid)
            if row is not None and (batch.reqs[row] is not req
                                    or batch.num_computed[row] != req.num_computed_tokens
                                    or batch.num_tokens[row] != req.num_tokens):
                batch.remove(rid)
                row = None
            if row is None:
                batch.add(req, out.block_ids[rid])
            else:
                batch.set_blocks(row, out.block_ids[rid])
        batch.condense()
        num_scheduled = np.zeros(batch.num_reqs, dtype=np.int64)
        for req, n in out.scheduled:
            num_scheduled[batch.index[req.request_id]] = n
        return num_scheduled

    def vision_spans(self, inp: StepInputs, num_scheduled: np.ndarray
                     ) -> list[tuple[int, torch.Tensor]]:
        """(flat row, payload rows [n, payload_width]) to write over placeholder rows: every
        image of the step goes through the tower in one call (cached ones skip it). A chunk
        that cuts an image takes its rows of the payload (embedding and extras alike)."""
        spans: list[tuple[int, MMItem, int, int]] = []  # (flat row, item, item row, n)
        batch = self.batch
        for row in np.flatnonzero(batch.num_computed[:batch.num_reqs]
                                  < batch.num_prompt[:batch.num_reqs]).tolist():
            req = batch.reqs[row]
            s = int(batch.num_computed[row])
            e = s + int(num_scheduled[row])
            base = int(inp.cu_seqlens_q[row])
            for it in req.mm_items:
                lo, hi = max(s, it.offset), min(e, it.end)
                if lo < hi:
                    spans.append((base + lo - s, it, lo - it.offset, hi - lo))
        if not spans:
            return []
        embs = self.encoder.get_embeddings([it for _, it, _, _ in spans])
        return [(row, embs[it.mm_hash][start:start + n]) for row, it, start, n in spans]

    def enable_cuda_graphs(self, sizes: list[int], max_model_len: int) -> int:
        """Capture the decode forward for these batch sizes over the current KV cache;
        returns the bytes the graphs hold (engine/cuda_graphs.py)."""
        num_layers, block_size, num_kv_heads, head_dim = self._kv_layout
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, self.ops, sizes,
                                      max_model_len, block_size, num_kv_heads, head_dim,
                                      self.dtype, self.device)
        return self.graphs.capture()

    def disable_cuda_graphs(self) -> None:
        """Drop the captured graphs (every step runs eagerly until captured again)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    @staticmethod
    def _whole(inp: StepInputs) -> bool:
        """Every flat row's logits, in order (a decode step): no gather needed.
        NOTE: prompt_logprobs rows come after the sampled ones: a count is not enough."""
        idx = inp.logits_index
        return len(idx) == len(inp.input_ids) and np.array_equal(idx, np.arange(len(idx)))

    def stage(self, inp: StepInputs, extra: list[np.ndarray] | None = None,
              graph_bucket: int | None = None) -> DeviceStep:
        """The step's inputs (and ``extra`` host arrays: the sampler's) on the device, with
        one host-to-device copy (engine/device_io.py; on the CPU, views of the arrays).
        ``graph_bucket``: the step replays that decode graph (its partition rides along)."""
        extra = list(extra or [])
        logits_index = inp.logits_index
        whole = self._whole(inp)
        max_seq_len = int(inp.seq_lens.max()) if len(inp.seq_lens) else 0
        if graph_bucket is not None:
            assert self.graphs is not None
            extra.append(self.graphs.partition_for(graph_bucket, max_seq_len))
        arrays = [inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables,
                  inp.cu_seqlens_q, inp.seq_lens, *([] if whole else [logits_index]), *extra]
        dev = self.staging.stage(arrays)
        meta = AttentionMetadata(
            slot_mapping=dev[2], block_tables=dev[3], cu_seqlens_q=dev[4], seq_lens=dev[5],
            max_query_len=inp.max_query_len, max_seq_len=max_seq_len,
            cu_seqlens_q_cpu=inp.cu_seqlens_q, seq_lens_cpu=inp.seq_lens, padded=False,
            no_cached_prefix=bool(np.array_equal(np.diff(inp.cu_seqlens_q), inp.seq_lens)))
        rest = dev[6 if whole else 7:]
        if graph_bucket is not None:
            return DeviceStep(dev[0], dev[1], meta, None, rest[:-1], graph_bucket, rest[-1])
        return DeviceStep(dev[0], dev[1], meta, None if whole else dev[6], rest)

    def run_model(self, inp: StepInputs, spans: list[tuple[int, torch.Tensor]],
                  marks: list[float], dev: DeviceStep | None = None) -> torch.Tensor | None:
        """The model on one step's flat batch: logits [S, vocab] of the sampled rows (None
        when no row samples). Appends the end of the vision, forward and logits phases
        to ``marks``. Every rank of a tensor-parallel group runs this on the same inputs.

        NOTE: nothing here reads a device value back: sizes come from ``inp`` (the host)."""
        if dev is None:
            dev = self.stage(inp)
        if dev.graph_bucket is not None:  # a decode step: replay its captured graph
            assert self.graphs is not None and not spans
            marks.append(time.perf_counter())
            hidden = self.graphs.replay(dev.input_ids, dev.positions, dev.meta,
                                        dev.graph_partition, dev.graph_bucket)
            marks.append(time.perf_counter())
            logits = self.model.compute_logits(hidden)  # (the graph ends at the hidden states)
            marks.append(time.perf_counter())
            return logits
        embeds = self.model.embed_tokens(dev.input_ids)
        # the model contract: payload rows -> embedding rows (+ whatever else the model
        # consumes at those rows, e.g. DeepStack features, passed on to forward)
        extra = self.model.merge_vision(embeds, spans) if spans else {}
        marks.append(time.perf_counter())
        with forward_context(ForwardContext(dev.meta, self.kv_caches, self.ops)):
            hidden = self.model(dev.input_ids, dev.positions, embeds, **extra)
        marks.append(time.perf_counter())
        if not len(inp.logits_index):
            marks.append(marks[-1])
            return None
        if dev.logits_index is not None:
            hidden = hidden[dev.logits_index]
        greedy = getattr(self.model, "greedy_tokens", None) if self.greedy_step else None
        ids = greedy(hidden) if greedy is not None else None
        if ids is not None:  # the head's argmax without the [S, vocab] logits
            marks.append(time.perf_counter())
            return GreedyIds(ids)  # type: ignore[return-value]
        logits = self.model.compute_logits(hidden)
        marks.append(time.perf_counter())
        return logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput
                ) -> tuple[dict[str, int], dict[str, dict[int, float] | None]]:
        """Run one step; returns sampled token ids and their logprobs by request id.

        One copy in (``stage``: inputs + sampling arrays), one copy out (``fetch``: the
        sampled ids, plus the logprobs asked for)."""
        marks = [time.perf_counter()]
        num_scheduled = self._sync(out)
        inp = self.batch.prepare(num_scheduled)
        marks.append(time.perf_counter())
        self.greedy_step = self.greedy_head and self._plain_greedy(inp)
        rows = inp.sample_rows
        reqs = [self.batch.reqs[r] for r in rows.tolist()]
        rids = [r.request_id for r in reqs]
        params = [r.sampling_params for r in reqs]
        host = None if self.greedy_step or not len(rows) else \
            self.batch.sampling(rows, self.vocab_size)
        grammar = self.batch.grammars.fill(rids, self.vocab_size) \
            if self.batch.grammars and len(rows) else None
        extra = list(host.arrays) if host is not None else []
        if grammar is not None:
            extra += [grammar[0].numpy(), np.array(grammar[1], dtype=np.int64)]
        spans = self.vision_spans(inp, num_scheduled)
        bucket = None if self.graphs is None or spans or inp.prompt_rows else \
            self.graphs.bucket(len(inp.input_ids), inp.max_query_len, self._whole(inp))
        dev = self.stage(inp, extra, bucket)
        logits = self.run_model(inp, spans, marks, dev)
        result: tuple[dict[str, int], dict[str, dict[int, float] | None]] = ({}, {})
        if isinstance(logits, GreedyIds):  # (the CPU's packed head: ids already on the host)
            ids = self.fetch.fetch([logits.ids])[0].tolist()
            for row, tok in zip(rows.tolist(), ids):
                self.batch.append_token(row, tok)
            result, logits = (dict(zip(rids, ids)), dict.fromkeys(rids)), None
        if logits is not None and inp.prompt_rows:
            self._prompt_logprobs(inp, logits[len(rows):])
            logits = logits[:len(rows)]
        if logits is not None and len(rows):
            logits = logits.float()
            n_host = len(host.arrays) if host is not None else 0
            if grammar is not None:
                bitmask, idx = dev.extra[n_host:n_host + 2]
                logits = apply_bitmask(logits, bitmask, idx)
            if host is None:  # plain greedy with the logits (no packed head)
                ids_dev, lp = self.sampler.argmax(logits), None
            else:
                st = self.sampler.bind(host, dev.extra[:n_host], rids, params, self.device)
                ids_dev, lp = self.sampler.sample(logits, st)
            got = self.fetch.fetch([ids_dev.to(torch.int32), *(lp or ())])
            ids = got[0].tolist()
            res = to_output(ids, tuple(got[1:]) if lp is not None else None, host, params)
            for row, tok in zip(rows.tolist(), ids):
                self.batch.append_token(row, tok)
            result = dict(zip(rids, res.token_ids)), dict(zip(rids, res.logprobs))
        self.batch.advance(num_scheduled)
        marks.append(time.perf_counter())
        self.times.add(marks)
        return result

    def _plain_greedy(self, inp: StepInputs) -> bool:
        """Every sampled row is greedy with nothing that reads its logits (no logprobs,
        logit_bias, penalties, grammar; no prompt_logprobs rows): the sampler would only
        take each row's argmax, which the head can give without the logits."""
        if not len(inp.sample_rows) or inp.prompt_rows or self.batch.grammars or \
                self.batch.penalties:
            return False
        for r in inp.sample_rows.tolist():
            sp = self.batch.reqs[r].sampling_params
            if not sp.greedy or sp.logprobs is not None or sp.logit_bias:
                return False
        return True

    def _prompt_logprobs(self, inp: StepInputs, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this step's logits predict (prompt_logprobs): the
        top k and the prompt's own token per position, computed on the device and read in
        one copy."""
        # logits: [P, vocab], one row per (row, position) of inp.prompt_rows, in order
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = np.concatenate([
            np.asarray(self.batch.reqs[row].prompt_token_ids[t0 + 1:t0 + 1 + count])
            for row, t0, count in inp.prompt_rows]).astype(np.int64)
        k = max(self.batch.reqs[row].sampling_params.prompt_logprobs or 0
                for row, _, _ in inp.prompt_rows)
        tgt = to_device(torch.from_numpy(targets), lp.device)
        tops = lp.topk(max(k, 1), dim=-1)
        chosen, top_v, top_i = self.fetch.fetch(
            [lp.gather(1, tgt[:, None])[:, 0], tops.values, tops.indices])
        off = 0
        for row, t0, count in inp.prompt_rows:
            req = self.batch.reqs[row]
            kk = req.sampling_params.prompt_logprobs or 0
            for j in range(count):
                d = dict(zip(top_i[off + j, :kk].tolist(), top_v[off + j, :kk].tolist()))
                d[int(targets[off + j])] = float(chosen[off + j])
                req.prompt_logprobs[t0 + 1 + j] = d  # keyed by the token it scores
            off += count

    # -- KV blocks by id (a prefill worker's KVSender, a decode worker's KVReceiver) ---------
    # NOTE (GPU): no pageable copy and no stream-wide sync. Export: the block ids go over
    # pinned + non_blocking, the blocks are gathered on the device and come back in one
    # copy into pinned memory, waited on by its event (a KV lane's thread reads them).
    # Import: ids and blocks are packed into the import staging's pinned buffer (reused:
    # it waits only for its own previous copy), copied once, then scattered on the device.
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[num_layers, 2, n, block_size, num_kv_heads, head_dim] host copy of these blocks."""
        idx = to_device(torch.tensor(block_ids, dtype=torch.long), self.device)
        return to_host(torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                                    for k, v in self.kv_caches]))

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write ``kv`` (``read_blocks``' layout, on the host) into these blocks."""
        idx, data = self.kv_staging.stage([np.asarray(block_ids, dtype=np.int64), kv])
        for (kc, vc), layer in zip(self.kv_caches, data):
            kc.index_copy_(0, idx, layer[0].to(kc.dtype))
            vc.index_copy_(0, idx, layer[1].to(vc.dtype))

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """(block_size, num_kv_heads, head_dim) of one block of one layer, as transferred
        (all heads of the model, also when this runner holds a slice of them)."""
        return tuple(self.kv_caches[0][0].shape[1:])


def _text_config(model: Any) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config
