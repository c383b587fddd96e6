"""ModelRunner: a SchedulerOutput in, sampled token ids out.

It owns the KV cache tensors and a persistent ``InputBatch`` (engine/runner/input_batch.py) that
holds each scheduled request's token ids, counters and block table across steps; a step
syncs the batch with the scheduler's decision (join, leave, new blocks), flattens it with
a few vectorised ops and runs the model once:

    request:        r0 (decode)   r2 (decode)   r1 (prefill chunk 16..40)
    flat tokens:    [t]           [t]           [t t t ... t]  (24)
    cu_seqlens_q:   0, 1,         2,                          26
    seq_lens:       ctx0+1,       ctx2+1,                     40

Rows follow the batch's order (decodes first), not the scheduler's: outputs are keyed by
request id. Image placeholder rows of the flat batch are overwritten with vision
embeddings taken from the encoder runner (a chunk may cover only part of an image's span).

A step runs in three calls, so the engine core can overlap the host's work with the
device's (async scheduling, engine/engine_core.py):

    prepare(out)   -> PendingStep   inputs staged (one copy), the forward and the LM head
                                    launched; a row whose input is the previous step's
                                    sampled token takes it from that step's device ids
    sample(p)      -> InFlight      grammar bitmask, sampling arrays (a second copy only
                                    when some row needs them), the sampler, then the ids'
                                    copy to the host started (not waited for)
    collect(f)     -> StepOutput    the one wait of the step: the ids (and logprobs) read

``execute`` is the three in a row (the synchronous step).
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from triptych.engine.device.cuda_graphs import CudaGraphRunner
from triptych.engine.device.device_io import HostFetch, StepStaging, to_device, to_host
from triptych.engine.device.platform import sampler_argmax, sampler_draw
from triptych.engine.encoder.encoder_runner import EncoderRunner
from triptych.engine.request import MMItem
from triptych.engine.runner.batch_sync import sync_batch
from triptych.engine.runner.forward_context import (
    AttentionMetadata,
    ForwardContext,
    forward_context,
)
from triptych.engine.runner.input_batch import InputBatch, StepInputs
from triptych.engine.runner.prompt_logprobs import record_prompt_logprobs
from triptych.engine.runner.step_state import (
    NO_ARRAYS,
    DeviceStep,
    GreedyIds,
    InFlight,
    PendingStep,
    StepOutput,
    StepTimes,
    device_inputs,
    in_flight_rows,
)
from triptych.engine.sample.sampler import Argmax, Sampler, to_output
from triptych.engine.scheduler import SchedulerOutput
from triptych.engine.structured.grammar import apply_bitmask


class RunnerBroken(Exception):
    """The runner's state cannot be trusted any more (e.g. a tensor-parallel group out of
    step): the engine must not retry the step per request; the worker stops instead.

    NOTE: not a RuntimeError, which callers catch to retry a request alone."""


class ModelRunner:
    # Plain-greedy steps may take their tokens from the model's ``greedy_tokens`` (the head's
    # argmax, no logits). A tensor-parallel runner gathers vocab slices of the logits, so
    # it turns this off.
    greedy_head = True
    supports_async = True  # a tensor-parallel runner sends host ids to its ranks: no

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
        self.sampler = Sampler(seed, argmax or sampler_argmax(device), sampler_draw(device))
        # the logits' width (every rank's slices together): the checkpoint's text vocab
        self.vocab_size = vocab_size or _text_config(model).vocab_size
        self.staging = StepStaging(device)  # one host -> device copy per step
        self.sample_staging = StepStaging(device)  # the sampler's arrays, when a row has any
        self.fetch = HostFetch(device)  # one device -> host copy per step
        self._last: InFlight | None = None  # the sampled step not collected yet
        self.num_inputs_from_device = 0  # input ids read from a previous step's device ids
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
        returns the bytes the graphs hold (engine/device/cuda_graphs.py)."""
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
        """Every flat row's logits, in order (a decode step): no gather needed (NOTE:
        prompt_logprobs rows come after the sampled ones: a count is not enough)."""
        idx = inp.logits_index
        return len(idx) == len(inp.input_ids) and np.array_equal(idx, np.arange(len(idx)))

    def stage(self, inp: StepInputs, extra: list[np.ndarray] | None = None,
              graph_bucket: int | None = None) -> DeviceStep:
        """The step's inputs (and ``extra`` host arrays: the sampler's) on the device, with
        one host-to-device copy (engine/device/device_io.py; on the CPU, views of the arrays).
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
        q_lens = np.diff(inp.cu_seqlens_q)
        meta = AttentionMetadata(
            slot_mapping=dev[2], block_tables=dev[3], cu_seqlens_q=dev[4], seq_lens=dev[5],
            max_query_len=inp.max_query_len, max_seq_len=max_seq_len,
            cu_seqlens_q_cpu=inp.cu_seqlens_q, seq_lens_cpu=inp.seq_lens, padded=False,
            no_cached_prefix=bool(np.array_equal(q_lens, inp.seq_lens)),
            # rows of one token lead the batch (InputBatch.decodes_first)
            num_decodes=0 if inp.max_query_len == 1 else int(np.argmax(q_lens != 1)))
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

    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Run one step and wait for it: ``prepare``, ``sample``, ``collect``."""
        assert self._last is None, "a step is in flight: collect it first"
        return self.collect(self.sample(self.prepare(out)))

    @torch.inference_mode()
    def prepare(self, out: SchedulerOutput) -> PendingStep:
        """The step's inputs on the device (one copy; tokens of the step in flight taken
        from its device ids), the vision tower, the forward and the LM head launched."""
        marks = [time.perf_counter()]
        num_scheduled = sync_batch(self.batch, out)
        in_flight = in_flight_rows(self.batch, self._last)
        inp = self.batch.prepare(num_scheduled, in_flight)
        marks.append(time.perf_counter())
        self.greedy_step = self.greedy_head and self._plain_greedy(inp)
        rows = inp.sample_rows.tolist()
        reqs = [self.batch.reqs[r] for r in rows]
        spans = self.vision_spans(inp, num_scheduled)
        bucket = None if self.graphs is None or spans or inp.prompt_rows else \
            self.graphs.bucket(len(inp.input_ids), inp.max_query_len, self._whole(inp))
        subst = device_inputs(self.batch, self._last, inp, num_scheduled, in_flight)
        dev = self.stage(inp, subst, bucket)
        if subst:  # (no read: device ids into device inputs)
            assert self._last is not None and self._last.ids is not None
            flat, src = dev.extra[:2]
            dev.input_ids.index_copy_(0, flat, self._last.ids.index_select(0, src))
            self.num_inputs_from_device += len(subst[0])
        logits = self.run_model(inp, spans, marks, dev)
        if isinstance(logits, torch.Tensor) and inp.prompt_rows:
            # NOTE: reads its own copy now (a step with prompt logprobs waits for its forward)
            record_prompt_logprobs(self.batch, inp, logits[len(rows):], self.fetch)
            logits = logits[:len(rows)]
        self.batch.advance(num_scheduled)
        needs = bool(self.batch.penalties or self.batch.grammars) and any(
            in_flight[r] and (q.request_id in self.batch.penalties
                              or q.request_id in self.batch.grammars)
            for r, q in zip(rows, reqs))
        return PendingStep(out, reqs, logits, marks, needs)

    @torch.inference_mode()
    def sample(self, p: PendingStep) -> InFlight:
        """Sample the step's rows on the device and start the copy of their ids (and
        logprobs) to the host. The grammar bitmask and the penalties read the batch's
        tokens: a step whose ``needs_previous`` must come after the previous ``collect``."""
        reqs, logits = p.reqs, p.logits
        rids = [r.request_id for r in reqs]
        batch = self.batch
        f = InFlight(p.sched, reqs, None, None, None, False)
        if isinstance(logits, GreedyIds):  # (the CPU's packed head: no logits at all)
            f.ids = logits.ids.long()
            f.copy = self.fetch.start([f.ids])
        elif logits is not None and reqs:
            rows = np.array([batch.index[rid] for rid in rids], dtype=np.int64)
            host = None if self.greedy_step else batch.sampling(rows, self.vocab_size)
            grammar = batch.grammars.fill(rids, self.vocab_size) if batch.grammars else None
            f.dead = batch.grammars.take_dead()  # (a dead row's matcher is gone already)
            extra = list(host.arrays) if host is not None else []
            if grammar is not None:
                extra += [grammar[0], np.array(grammar[1], dtype=np.int64)]
            dev = self.sample_staging.stage(extra) if extra else []
            logits = logits.float()
            n_host = len(host.arrays) if host is not None else 0
            if grammar is not None:
                logits = apply_bitmask(logits, dev[n_host], dev[n_host + 1])
            lp = None
            if host is None:  # plain greedy
                f.ids = self.sampler.argmax(logits)
            else:
                params = [r.sampling_params for r in reqs]
                st = self.sampler.bind(host, dev[:n_host], rids, params, self.device)
                f.ids, lp = self.sampler.sample(logits, st)
            f.host, f.has_logprobs = host, lp is not None
            f.copy = self.fetch.start([f.ids.to(torch.int32), *(lp or ())])
        self._last = f if f.ids is not None else None
        p.marks.append(time.perf_counter())
        self.times.add(p.marks)
        return f

    def drop_in_flight(self, keep: InFlight | None) -> None:
        """After a failed ``prepare`` / ``sample``: the step in flight is ``keep`` again
        (the failed step's half-made record is dropped)."""
        self._last = keep

    def collect(self, f: InFlight) -> StepOutput:
        """Wait for the step's ids (the one wait of a step), record them in the batch."""
        if self._last is f:
            self._last = None
        if f.copy is None:
            return StepOutput(dead=f.dead)
        got = self.fetch.wait(f.copy)
        ids = got[0].tolist()
        params = [r.sampling_params for r in f.reqs]
        res = to_output(ids, tuple(got[1:]) if f.has_logprobs else None,
                        f.host if f.host is not None else NO_ARRAYS, params)
        batch = self.batch
        for req, tok in zip(f.reqs, ids):
            row = batch.index.get(req.request_id)
            if row is not None and batch.reqs[row] is req:  # (it may have left meanwhile)
                batch.append_token(row, tok)
            elif row is None:
                batch.rested_token(req, tok)  # (sitting this step out)
        rids = list(f.index)
        return StepOutput(dict(zip(rids, res.token_ids)), dict(zip(rids, res.logprobs)),
                          f.dead)

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

    # -- KV blocks by id (a prefill worker's KVSender, a decode worker's KVReceiver) ---------
    # NOTE (GPU): no pageable copy, no stream-wide sync. Export: gathered on the device, one
    # copy into pinned memory, its event waited on. Import: ids and blocks packed into the
    # import staging's reused pinned buffer, copied once, scattered on the device.
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

