"""From a request body to engine jobs, in this order:

    1. the validation pass (api/request_checks.py): refusals and cost bounds, no work
    2. the structured-output compile check (P0's bounded compile processes)
    3. admission (api/admission.py): engine sequences held, per tenant
    4. media fetched (http(s) on their own pool), then the processor: chat template,
       tokens, images and videos (off the event loop)
    5. truncation, the context-length check, the sampling parameters

Preparation reads only the checked request; the refusals it can still make are those that
need the work itself (undecodable media, a rendered prompt longer than the context).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import anyio
from triptych.api.admission import Admission, Slots
from triptych.api.errors import APIError
from triptych.api.grammar_check import GrammarChecker
from triptych.api.media.decode import MediaError, PixelBudget
from triptych.api.media.prefetch import MediaFetcher
from triptych.api.openai_format import PromptInfo
from triptych.api.processor import InputProcessor
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest
from triptych.api.request_checks import (
    CheckedRequest,
    ServerLimits,
    check_chat,
    check_completion,
    sampling_params,
)
from triptych.api.sampling_checks import context_error
from triptych.api.serving import Job
from triptych.api.structured import check_structured
from triptych.api.truncation import keep_count, truncate
from triptych.router.prompt import ProcessedPrompt

TEXT_THREADS = 16  # requests without media prepared at once (template, tokens)
MEDIA_THREADS = 32  # requests with media (their threads mostly wait on preparation)


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
        self._text_threads = anyio.CapacityLimiter(TEXT_THREADS)
        self._media_threads = anyio.CapacityLimiter(MEDIA_THREADS)
        tok = processor.tokenizer  # structured output: P0's compile check (api/structured.py)
        self.grammars = GrammarChecker(tok, limits.vocab_size, tok.eos_token_id,
                                       limits.grammar_compile_procs,
                                       limits.grammar_compile_timeout_s)

    async def _admit(self, checked: CheckedRequest, tenant: str | None) -> Slots:
        await check_structured(checked.structured, checked.body, self.grammars, tenant)
        if not self.alive():
            raise APIError(503, "the engine is not running", "server_error")
        return self.admission.reserve(checked.sequences, tenant)

    async def _run(self, fn: Callable[[], Any], media: bool = False) -> Any:
        """``fn`` (the chat template, the tokenizer, media keys and their preparation) in a
        thread off the event loop. Requests with media and those without take threads
        from separate allowances: a flood of image requests (whose threads wait on the
        preparation processes) never leaves a text request waiting for a thread."""
        from jinja2 import TemplateError

        try:
            return await anyio.to_thread.run_sync(
                fn, limiter=self._media_threads if media else self._text_threads)
        except ValueError as e:  # MediaError included: its message is meant for clients
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        except TemplateError as e:  # the template's raise_exception(...) speaks to clients
            raise APIError(400, f"the chat template refused the messages: {e}",
                           param="messages") from None

    def _job(self, checked: CheckedRequest, prompt: ProcessedPrompt, echo: str) -> Job:
        """Truncate if asked, check the length, build the sampling parameters (which carry
        the request's cache scope to every pool's prefix cache)."""
        body = checked.body
        if body.truncate_prompt_tokens is not None:
            keep = keep_count(body.truncate_prompt_tokens, self.limits.max_model_len,
                              body.requested_max_tokens[1])
            prompt = truncate(prompt, keep, body.truncation_side or "left")
        n = len(prompt.prompt_token_ids)
        if n >= self.limits.max_model_len:  # (the processor checks it when not truncating)
            raise context_error(self.limits.max_model_len, n, None, checked.chat,
                                "messages" if checked.chat else "prompt")
        self.num_mm_items += len(prompt.mm_items)
        sp = sampling_params(checked, n, self.limits)
        info = PromptInfo(prompt.prompt_token_ids, echo=echo, mm_tokens=_mm_tokens(prompt))
        return Job(prompt, sp, info)

    def _view(self, checked: CheckedRequest) -> InputProcessor:
        media = checked.media
        if media is not None:  # this request's pixel budget
            media = dataclasses.replace(media, budget=PixelBudget(media.max_request_pixels))
        return self.processor.for_request(media, checked.body.truncate_prompt_tokens is None,
                                          checked.scope, checked.tenant)

    async def chat(self, body: ChatCompletionRequest, tenant: str | None = None
                   ) -> tuple[list[Job], Slots]:
        """``tenant``: the API key's (None: anonymous); with the body's ``cache_salt`` it
        scopes the request's uuids and prefix cache (api/tenancy.py)."""
        checked = check_chat(body, self.limits, tenant)
        slots = await self._admit(checked, tenant)
        try:
            view = self._view(checked)
            try:
                await self.fetcher.prefetch(checked.messages, view.media)
            except MediaError as e:
                raise APIError(400, str(e), param=e.param or "messages") from None
            prompt = await self._run(lambda: view.process_chat(
                checked.messages, add_generation_prompt=checked.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=checked.template_kwargs), media=checked.has_media)
            job = self._job(checked, prompt, checked.echo)
        except BaseException:
            slots.release_all()
            raise
        return [job], slots

    async def completion(self, body: CompletionRequest, tenant: str | None = None
                         ) -> tuple[list[Job], Slots]:
        """As ``chat``; one job per prompt."""
        checked = check_completion(body, self.limits, tenant)
        slots = await self._admit(checked, tenant)
        try:
            view = self._view(checked)
            processed = await self._run(
                lambda: [view.process_prompt(p) for p in checked.prompts])
            decode = self.processor.tokenizer.decode
            jobs = []
            for p, pp in zip(checked.prompts, processed):
                job = self._job(checked, pp, "")
                if body.echo:  # the prompt as given, or as kept after truncation
                    kept = job.prompt
                    job.info.echo = p if isinstance(p, str) and kept.prompt_text is not None \
                        else decode(kept.prompt_token_ids)
                jobs.append(job)
        except BaseException:
            slots.release_all()
            raise
        return jobs, slots


__all__ = ["InputStage"]
