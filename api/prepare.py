"""From a validated request body to engine jobs: admission, media fetching, the processor
(chat template, tokenizer, images and videos, in a worker thread), truncation, sampling
parameters. Cheap checks come first (api/request_checks.py), so a request that will be
refused costs no fetch, no decode and no tokenization.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import anyio
from triptych.api.errors import APIError
from triptych.api.grammar_check import GrammarChecker
from triptych.api.media.decode import MediaError, PixelBudget
from triptych.api.media.prefetch import MediaFetcher
from triptych.api.openai_format import PromptInfo
from triptych.api.processor import InputProcessor
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest
from triptych.api.request_checks import (
    ServerLimits,
    check_chat,
    check_completion,
    media_limits,
    sampling_params,
    template_kwargs,
)
from triptych.api.sampling_checks import context_error
from triptych.api.serving import Admission, Job, Slots
from triptych.api.structured import check_structured
from triptych.api.tenancy import cache_scope
from triptych.api.truncation import keep_count, truncate
from triptych.router.prompt import ProcessedPrompt


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.text for p in content or [] if p.type == "text")


def _mm_tokens(prompt: ProcessedPrompt) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in prompt.mm_items:
        out[it.modality] = out.get(it.modality, 0) + it.length
    return out


class InputStage:
    def __init__(self, processor: InputProcessor, limits: ServerLimits, admission: Admission,
                 fetcher: MediaFetcher, alive: Callable[[], bool]) -> None:
        self.processor, self.limits, self.admission = processor, limits, admission
        self.fetcher, self.alive = fetcher, alive
        self.num_mm_items = 0  # images/videos processed (the processor cache's queries)
        tok = processor.tokenizer  # structured output: P0's compile check (api/structured.py)
        self.grammars = GrammarChecker(tok, limits.vocab_size, tok.eos_token_id,
                                       limits.grammar_compile_procs,
                                       limits.grammar_compile_timeout_s)

    def _admit(self, k: int) -> Slots:
        if not self.alive():
            raise APIError(503, "the engine is not running", "server_error")
        return self.admission.reserve(k)

    async def _run(self, fn: Callable[[], Any]) -> Any:
        from jinja2 import TemplateError

        try:  # media decoding, the HF processor and the tokenizer: off the event loop
            return await anyio.to_thread.run_sync(fn)
        except ValueError as e:  # MediaError included: its message is meant for clients
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        except TemplateError as e:  # the template's raise_exception(...) speaks to clients
            raise APIError(400, f"the chat template refused the messages: {e}",
                           param="messages") from None

    def _finish(self, body: Any, prompt: ProcessedPrompt, logprobs: int | None, param: str,
                scope: str) -> tuple[ProcessedPrompt, Any]:
        """Truncate if asked, check the length, build the sampling parameters (which carry
        the request's cache scope to every pool's prefix cache)."""
        if body.truncate_prompt_tokens is not None:
            keep = keep_count(body.truncate_prompt_tokens, self.limits.max_model_len,
                              body.requested_max_tokens[1])
            prompt = truncate(prompt, keep, body.truncation_side or "left")
        n = len(prompt.prompt_token_ids)
        if n >= self.limits.max_model_len:  # (the processor checks it when not truncating)
            raise context_error(self.limits.max_model_len, n, None,
                                isinstance(body, ChatCompletionRequest), param)
        self.num_mm_items += len(prompt.mm_items)
        sp = sampling_params(body, n, self.limits, logprobs)
        sp.cache_salt = scope or None
        return prompt, sp

    async def chat(self, body: ChatCompletionRequest, tenant: str | None = None
                   ) -> tuple[list[Job], Slots]:
        """``tenant``: the API key's (None: anonymous); with the body's ``cache_salt`` it
        scopes the request's uuids and prefix cache (api/tenancy.py)."""
        check_chat(body, self.limits)
        scope = cache_scope(tenant, body.cache_salt)
        await check_structured(body, self.grammars, tenant, self.limits.max_structured_depth)
        messages = body.message_dicts()
        media = media_limits(body, self.limits.media)
        media = dataclasses.replace(media, budget=PixelBudget(media.max_request_pixels))
        view = self.processor.for_request(media, body.truncate_prompt_tokens is None, scope)
        add_generation = body.add_generation_prompt
        if add_generation is None:
            add_generation = not body.continue_final_message
        kwargs = template_kwargs(body)
        last = body.messages[-1]
        echo = _text(last.content) if body.echo and last.role == "assistant" else ""
        slots = self._admit(1)
        try:
            try:
                await self.fetcher.prefetch(messages, media)
            except MediaError as e:
                raise APIError(400, str(e), param=e.param or "messages") from None
            prompt = await self._run(lambda: view.process_chat(
                messages, add_generation_prompt=add_generation,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=kwargs))
            prompt, sp = self._finish(body, prompt, (body.top_logprobs or 0)
                                      if body.logprobs else None, "messages", scope)
        except BaseException:
            slots.release_all()
            raise
        info = PromptInfo(prompt.prompt_token_ids, echo=echo, mm_tokens=_mm_tokens(prompt))
        return [Job(prompt, sp, info)], slots

    async def completion(self, body: CompletionRequest, tenant: str | None = None
                         ) -> tuple[list[Job], Slots]:
        """As ``chat``."""
        check_completion(body, self.limits)
        scope = cache_scope(tenant, body.cache_salt)
        await check_structured(body, self.grammars, tenant, self.limits.max_structured_depth)
        prompts = body.prompts()
        view = self.processor.for_request(None, body.truncate_prompt_tokens is None, scope)
        decode = self.processor.tokenizer.decode
        slots = self._admit(len(prompts))
        try:
            processed = await self._run(lambda: [view.process_prompt(p) for p in prompts])
            jobs = []
            for p, pp in zip(prompts, processed):
                pp, sp = self._finish(body, pp, body.logprobs, "prompt", scope)
                echo = ""
                if body.echo:  # the prompt as given, or as kept after truncation
                    echo = p if isinstance(p, str) and pp.prompt_text is not None else \
                        decode(pp.prompt_token_ids)
                jobs.append(Job(pp, sp, PromptInfo(pp.prompt_token_ids, echo=echo)))
        except BaseException:
            slots.release_all()
            raise
        return jobs, slots


__all__ = ["InputStage"]
