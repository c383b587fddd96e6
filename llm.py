"""LLM: the offline entry point for batch jobs (OCR pipelines, evaluations).

By default the engine runs in this process. With pool knobs (``encode_workers``,
``prefill_workers``, ``decode_workers``), ``data_parallel_size > 1`` or
``tensor_parallel_size > 1`` the same router and worker processes as ``triptych serve``'s
run the batch (``llm.close()`` stops them; they also stop when this process exits).

    from triptych import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint", max_num_seqs=64)
    outs = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///data/page1.png"}},
        {"type": "text", "text": "Transcribe this page."}]}],
        SamplingParams(temperature=0.0, max_tokens=512))

Tenancy as on the server (docs/tenancy.md): a prompt dict's ``"cache_salt"`` (vLLM's) or
``chat(..., cache_salt=...)`` scopes that request's prefix-cache hits and media uuids; a
request with another salt (or none) neither hits nor resolves them.

``del llm`` (then ``gc.collect()``) frees what ``close()`` frees, pools, processes, Ray
actors and placement groups, shared memory, threads and device memory included: the
engine's parts are released by a ``weakref.finalize`` that holds them, not the LLM.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Self

import msgspec
from tqdm.auto import tqdm
from triptych.router.prompt import ProcessedPrompt
from triptych.config import EngineConfig
from triptych.llm_engine import LLMEngine
from triptych.engine.sample.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    beam_max_tokens,
    beam_output,
    beam_prompt,
)
from triptych.engine.sizing.memory import release_device_memory
from triptych.engine.outputs import RequestOutput
from triptych.engine.sample.sampling_params import SamplingParams

PromptType = Any  # str | list[int] | {"prompt": str, "multi_modal_data": {...}} | ProcessedPrompt


def _release(parts: list[Any]) -> None:
    """What ``close()`` and the garbage collector free (run once, whichever comes first).
    ``parts``: [engine, pools], emptied first so that nothing holds the engine while its
    device memory goes back."""
    engine, pools = parts
    parts.clear()
    if pools is not None:
        pools.close()
    if engine is not None:
        engine.close()
        del engine
        release_device_memory()


class LLM:
    def __init__(self, model: str, **knobs: Any) -> None:
        from transformers import AutoConfig, AutoTokenizer
        from triptych.router.layout import Layout
        from triptych.api.media.decode import MediaLimits
        from triptych.api.processor import InputProcessor
        from triptych.engine.sizing.model_shape import resolve_max_model_len
        from triptych.mmcache import ProcessorCacheIndex, processor_cache_bytes

        self.config = EngineConfig.from_kwargs(model=model, **knobs)
        self.layout = Layout.from_config(self.config)
        self.engine: LLMEngine | None = None
        self.pools = None  # RouterThread when the work runs in worker processes
        self._local_pixels = None  # the processor cache of the in-process engine
        # NOTE: with Ray even one colocated engine is an actor (placed by the cluster)
        in_process = self.layout.in_process and self.config.distributed_executor_backend == "mp"
        if in_process:
            self.engine = LLMEngine(self.config)
            tokenizer, max_len = self.engine.tokenizer, self.engine.max_model_len
        else:
            tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or model,
                                                      local_files_only=True)
            hf = AutoConfig.from_pretrained(model, local_files_only=True)
            max_len = resolve_max_model_len(
                self.config, getattr(hf, "text_config", hf).max_position_embeddings)
        self.tokenizer = tokenizer
        self.max_model_len = max_len
        cache_bytes = processor_cache_bytes(self.config.mm_processor_cache_gb)
        self.processor = InputProcessor(
            model, limit_mm_per_prompt=self.config.limit_mm_per_prompt,
            media_limits=MediaLimits(allowed_local_media_path=self.config.allowed_local_media_path),
            max_model_len=max_len, tokenizer=tokenizer,
            cache=ProcessorCacheIndex(cache_bytes) if cache_bytes else None,
            mm_preprocessor=self.config.mm_preprocessor)
        if self.config.mm_preprocessor == "fast":  # the resize kernel built or loaded now
            from triptych.models import image_ops

            image_ops.load_resize()
        if in_process and cache_bytes:
            from triptych.mmcache.local import LocalPixels
            self._local_pixels = LocalPixels(cache_bytes, self.processor)
            self.processor.fill_pixels = self._local_pixels.fill
        elif not in_process:
            from triptych.router.thread import RouterThread
            self.pools = RouterThread(self.config, tokenizer, self.processor)
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, _release, [self.engine, self.pools])

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def close(self) -> None:
        """Stop the worker processes (pools), or release the in-process engine: its model,
        KV cache and encoder cache are dropped (on CUDA their memory goes back to the
        device, so another engine in this process starts with the whole share)."""
        self.engine = None
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in the order of the prompts. A prompt
        dict may carry ``"cache_salt"`` (vLLM's): its prefix cache and uuids are its own."""
        processed, scopes = self._prompts(prompts)
        return self._run(processed, sampling_params, use_tqdm, scopes=scopes)

    def _prompts(self, prompts: PromptType | Sequence[PromptType]
                 ) -> tuple[list[ProcessedPrompt], list[str | None]]:
        """One prompt or a list of them, processed, and each one's cache scope. Already-
        processed prompts (ProcessedPrompt) pass through: benchmarks and pipelines that
        preprocess ahead of time do not pay for it twice."""
        if isinstance(prompts, (str, dict, ProcessedPrompt)) or (
                prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out, scopes = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, ProcessedPrompt):
                out.append(p)
                scopes.append(None)
                continue
            salt = None
            if isinstance(p, dict) and "cache_salt" in p:
                p = dict(p)
                salt = p.pop("cache_salt")
            view, scope = self._process(i, lambda s=salt: self._salted(s))
            out.append(self._process(i, lambda p=p, v=view: v.process_prompt(p)))
            scopes.append(scope)
        return out, scopes

    def _salted(self, salt: Any) -> tuple[Any, str | None]:
        """The processor view and cache scope of a request with ``cache_salt`` (None: the
        shared ones). The scope is the server's for an anonymous request with this salt."""
        if salt is None:
            return self.processor, None
        if not isinstance(salt, str) or not salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        from triptych.api.tenancy import cache_scope

        scope = cache_scope(None, salt)
        return self.processor.for_request(scope=scope), scope

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             abort_if: Callable[[], bool] | None = None,
             cache_salt: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of OpenAI-style messages) or a list of them.
        ``continue_final_message`` continues the last message instead of starting a new
        one (vLLM's parameters; pass ``add_generation_prompt=False`` with it).
        ``abort_if`` is asked between engine steps: True aborts the requests and raises
        KeyboardInterrupt (`triptych chat`'s Ctrl-C; the in-process engine only).
        ``cache_salt``: one for every conversation, or one (or None) per conversation; it
        scopes their prefix-cache hits and media uuids (the server's ``cache_salt``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        salts = list(cache_salt) if isinstance(cache_salt, (list, tuple)) \
            else [cache_salt] * len(convs)
        if len(salts) != len(convs):
            raise ValueError(f"{len(salts)} cache salts for {len(convs)} conversations")
        views = [self._process(i, lambda s=s: self._salted(s)) for i, s in enumerate(salts)]
        processed = [self._process(i, lambda c=c, v=v: v.process_chat(
            c, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs))
            for i, (c, (v, _)) in enumerate(zip(convs, views))]
        return self._run(processed, sampling_params, use_tqdm, abort_if,
                         scopes=[scope for _, scope in views])

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``beam_width`` best continuations of each prompt
        (text, token ids or ``{"prompt", "multi_modal_data"}``), best first. Each step runs
        every live beam of every prompt as one batch of one-token requests; the prefix cache
        shares the prompts' KV (engine/sample/beam_search.py)."""
        if self.layout.has_prefill_pool:
            raise ValueError("beam search runs in colocated layouts only (not P+D)")
        processed, _ = self._prompts(prompts)
        searches = [BeamSearch(params, self.tokenizer.eos_token_id,
                               beam_max_tokens(params, len(pp.prompt_token_ids),
                                               self.max_model_len),
                               (self.processor.image_token_id, self.processor.video_token_id))
                    for pp in processed]
        while True:
            todo = [(s, beam_prompt(pp, toks)) for s, pp in zip(searches, processed)
                    for toks in s.pending()]
            if not todo:
                break
            outs = self._run([p for _, p in todo], [s.step_params() for s, _ in todo], use_tqdm)
            step: dict[int, list[dict[int, float]]] = {}
            for (s, _), out in zip(todo, outs):
                lps = out.outputs[0].logprobs[0]
                step.setdefault(id(s), []).append({t: lp.logprob for t, lp in lps.items()})
            for s in searches:
                if not s.done:
                    s.advance(step[id(s)])
        return [beam_output(s, pp.prompt_token_ids, self.tokenizer) for s, pp in
                zip(searches, processed)]

    @staticmethod
    def _process(index: int, fn: Any) -> Any:
        # All prompts are processed before any is queued: a bad one fails the call cleanly.
        try:
            return fn()
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from e

    def _run(self, processed: list[Any], params: Any, use_tqdm: bool,
             abort_if: Callable[[], bool] | None = None,
             scopes: list[str | None] | None = None) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(processed)
        if len(plist) != len(processed):
            raise ValueError(f"{len(plist)} sampling params for {len(processed)} prompts")
        for i, scope in enumerate(scopes or []):
            if scope is not None:  # the request's own copy: the prefix cache is scoped
                plist[i] = msgspec.structs.replace(plist[i], cache_salt=scope)
        bar = tqdm(total=len(processed), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        if self.pools is not None:
            reqs = [(str(next(self._ids)), pp, sp) for pp, sp in zip(processed, plist)]
            try:
                return self.pools.run(reqs, lambda out: bar.update(1))
            finally:
                bar.close()
        assert self.engine is not None
        ids = []
        try:
            for pp, sp in zip(processed, plist):
                if self._local_pixels is not None:
                    self._local_pixels.fill(pp)  # (a ProcessedPrompt made elsewhere)
                rid = str(next(self._ids))
                self.engine.add_request(rid, pp.prompt_token_ids, sp, pp.mm_items, pp.prompt_text)
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)
            bar.close()
            raise
        results: dict[str, RequestOutput] = {}
        out_tokens = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
            if abort_if is not None and abort_if():
                # NOTE: between steps, never inside one: the engine stays consistent.
                self.engine.abort_request([r for r in ids if r not in results])
                bar.close()
                raise KeyboardInterrupt
        bar.close()
        return [results[r] for r in ids]
