"""The validation pass: one pass over a request as sent, after its schema and body rules
(api/protocol.py) and before any work is done for it, that refuses what the server will not
serve and bounds what serving the rest costs.

    body (pydantic: types, ranges, rules between fields)
      -> check_chat / check_completion (this module: the server's flags, the vocabulary,
         the chat template's own size) -> CheckedRequest
      -> preparation (api/prepare.py): compile, admission, media, template, tokens
      -> sampling_params(checked, prompt length)

Every refusal is a 400 naming the field (``param``), the problem and the flag that sets the
limit. Nothing here fetches, decodes, renders or tokenises: a request refused costs a walk
over its body. Bounded here, from the body alone:

- text: the characters of every message and part, plus what the chat template writes
  around each message (api/template_cost.py), plus one per message and part (each costs
  the template a loop turn) -- at most ``--max-prompt-chars``;
- tokens: the special tokens the template writes around the messages are a lower bound
  of the prompt's length: past ``max_model_len`` the request is refused now, as it would
  be after rendering (unless it asks for truncation);
- output: ``n`` x prompts engine sequences (what admission counts), stop strings, logit
  bias and the n-gram guard's whitelist (each id inside the vocabulary, so a list holds
  at most the vocabulary), media per prompt (``limit_mm_per_prompt``) and their caps;
- structured output: parsed and its nesting bounded (compiled next, in P0's bounded
  compile processes).

Features the engine does not have are refused by name rather than silently ignored: a vLLM
client that sends ``logits_processors`` learns that it did not get them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from triptych.api.errors import APIError, bad_request
from triptych.api.media.decode import MediaLimits
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest
from triptych.api.sampling_checks import context_error, logit_bias, ngram_guard, some
from triptych.api.structured import structured_outputs
from triptych.api.template_cost import TemplateCost
from triptych.api.tenancy import cache_scope
from triptych.api.tools.checks import check_tools
from triptych.api.tools.plan import ToolSettings
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.structured.structured_params import StructuredOutputsParams

# apply_chat_template's own parameters (and the template's conversation variables) may not
# come in through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs"}
_MAX_TEMPLATE_KWARGS = 32
Body = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class ServerLimits:
    """What a request is checked against; one per server, set from its flags."""

    max_model_len: int
    vocab_size: int  # rows of the model's logits: token ids must be below this
    max_n: int = 16  # --max-n: completions per prompt (and best_of)
    max_prompt_chars: int = 0  # --max-prompt-chars (0: 20 x max_model_len)
    max_prompts: int = 256  # prompts in one /v1/completions request (= --max-pending-requests)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8, "video": 1})
    media: MediaLimits = field(default_factory=MediaLimits)
    max_structured_depth: int = 64  # --max-structured-depth: JSON nesting of a schema
    grammar_compile_timeout_s: float = 10.0  # --grammar-compile-timeout
    grammar_compile_procs: int = 2  # --grammar-compile-procs
    template: TemplateCost = field(default_factory=TemplateCost)  # the chat template's size
    tools: ToolSettings = field(default_factory=ToolSettings)  # --tool-call-parser, ...

    @property
    def prompt_chars(self) -> int:
        return self.max_prompt_chars or 20 * self.max_model_len


@dataclass
class CheckedRequest:
    """A request that passed the validation pass: everything preparation needs, checked,
    and what serving it costs, bounded. Preparation reads this, not the body's raw fields."""

    body: Body
    tenant: str | None  # its API key's (None: anonymous)
    scope: str  # what its uuids and prefix-cache blocks live under (tenant + cache_salt)
    sequences: int  # engine sequences it holds while it runs: prompts x n (admission)
    logprobs: int | None  # top alternatives per output token; None: none asked for
    structured: StructuredOutputsParams | None  # parsed and depth-checked, compiled next
    logit_bias: dict[int, float] | None
    ngram: dict[str, Any]  # the n-gram guard's SamplingParams fields
    messages: list[dict] = field(default_factory=list)  # chat: as the processor reads them
    media: MediaLimits | None = None  # chat: the server's caps, lowered by the request
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    echo: str = ""  # chat: the final assistant message's text, put before the answer
    min_prompt_tokens: int = 0  # a lower bound of the rendered prompt's length
    has_media: bool = False  # chat: images or videos to prepare
    prompts: list[str | list[int]] = field(default_factory=list)  # completions

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)


def _is_set(v: Any) -> bool:
    return v is not None and v != [] and v != {} and v != ""


# field -> (is it asking for something we do not do?, why it is refused)
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logits_processors": (_is_set, "custom logits processors are not supported"),
    "allowed_token_ids": (_is_set, "allowed_token_ids is not supported yet"),
    "bad_words": (_is_set, "bad_words is not supported yet"),
    "kv_transfer_params": (_is_set, "kv_transfer_params is not supported"),
    "priority": (lambda v: v != 0, "priority scheduling is not enabled on this server"),
    "spaces_between_special_tokens": (lambda v: v is False,
                                      "spaces_between_special_tokens=false is not supported"),
    "suffix": (_is_set, "suffix is not supported"),
    "chat_template": (_is_set, ("a chat template in the request is not allowed; the server "
                               "uses the model's")),
    "functions": (_is_set, "the legacy functions field is not supported; use tools"),
    "prompt_embeds": (_is_set, "prompt_embeds is not supported"),
    "mm_processor_kwargs": (_is_set, "mm_processor_kwargs is not supported yet"),
}


def _check_common(body: Body, limits: ServerLimits, num_prompts: int, tenant: str | None
                  ) -> CheckedRequest:
    for name, (asks, why) in _UNSUPPORTED.items():
        if name in type(body).model_fields and asks(getattr(body, name)):
            raise bad_request(name, why)
    if body.n > limits.max_n:
        raise bad_request("n", f"n is {body.n} but this server allows at most {limits.max_n} "
                               "completions per request (--max-n)")
    if body.best_of is not None:
        if body.best_of > limits.max_n:
            raise bad_request("best_of", f"best_of is {body.best_of} but this server allows "
                                         f"at most {limits.max_n} (--max-n)")
        if body.best_of != body.n:
            raise bad_request("best_of", "best_of different from n is not supported")
    t = body.truncate_prompt_tokens
    if t is not None and t > limits.max_model_len:
        raise bad_request("truncate_prompt_tokens", f"truncate_prompt_tokens is {t}, larger "
                                                    f"than max_model_len ({limits.max_model_len})")
    for tid in body.stop_token_ids or []:
        if tid >= limits.vocab_size:
            raise bad_request("stop_token_ids", f"stop token id {tid} is outside the "
                                                f"vocabulary [0, {limits.vocab_size})")
    _logprob_token_ids(body, limits.vocab_size)
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    return CheckedRequest(
        body, tenant, cache_scope(tenant, body.cache_salt), num_prompts * body.n, logprobs,
        structured_outputs(body, limits.max_structured_depth),
        logit_bias(body, limits.vocab_size), ngram_guard(body, limits.vocab_size))


def _logprob_token_ids(body: Body, vocab: int) -> None:
    """vLLM's rules for logprob_token_ids (its words: clients match them)."""
    ids = body.logprob_token_ids
    if ids is None:
        return
    if not ids:
        raise bad_request("logprob_token_ids", "`logprob_token_ids` must not be an empty list")
    if body.use_beam_search:
        raise bad_request("logprob_token_ids", "`logprob_token_ids` is not supported with "
                                               "beam search.")
    if body.logprobs is None or body.logprobs is False:
        raise bad_request("logprob_token_ids", "when using `logprob_token_ids`, `logprobs` "
                                               "must be set.")
    bad = sorted({t for t in ids if t >= vocab})
    if bad:
        raise bad_request("logprob_token_ids", f"logprob_token_ids out of vocabulary: "
                                               f"{some([str(t) for t in bad])} (the "
                                               f"vocabulary is [0, {vocab}))")


def _check_chars(n: int, limits: ServerLimits, param: str, what: str) -> None:
    # NOTE: before any rendering or tokenization: a huge prompt costs a walk, not seconds.
    if n > limits.prompt_chars:
        raise bad_request(param, f"the {what} {n} characters; this server takes at most "
                                 f"{limits.prompt_chars} (--max-prompt-chars)")


def check_chat(body: ChatCompletionRequest, limits: ServerLimits, tenant: str | None = None
               ) -> CheckedRequest:
    """The validation pass of a chat request (``tenant``: its API key's; None: anonymous)."""
    checked = _check_common(body, limits, 1, tenant)
    kinds = {"image": 0, "video": 0}
    # tool definitions count as text (the template renders them)
    chars = check_tools(body, limits.tools, limits.prompt_chars, limits.max_structured_depth)
    for m in body.messages:
        chars += 1
        if isinstance(m.content, str):
            chars += len(m.content)
        for p in m.content if isinstance(m.content, list) else []:
            chars += 1
            if p.type == "text":
                chars += len(p.text)
            else:
                kinds[p.type[:5]] += 1
    chars += sum(len(v) for d in body.documents or [] for v in d.values())
    around = limits.template.bound(m.role for m in body.messages)
    _check_chars(chars + around.chars, limits, "messages", "messages and the chat template "
                                                             "around them make at least")
    if around.tokens >= limits.max_model_len and body.truncate_prompt_tokens is None:
        raise bad_request("messages", context_error(
            limits.max_model_len, around.tokens, None, True, "messages").message +
            f" (the chat template alone writes at least {around.tokens} tokens around "
            f"{len(body.messages)} messages)")
    for kind, count in kinds.items():  # before any media is fetched
        if count > limits.limit_mm_per_prompt.get(kind, 0):
            raise bad_request("messages", f"{count} {kind}(s) in the prompt, but "
                                          f"limit_mm_per_prompt allows "
                                          f"{limits.limit_mm_per_prompt.get(kind, 0)} {kind}(s)")
    add_generation = body.add_generation_prompt
    if add_generation is None:
        add_generation = not body.continue_final_message
    last = body.messages[-1]
    echo = ""
    if body.echo and last.role == "assistant":
        echo = last.content if isinstance(last.content, str) else \
            "\n".join(p.text for p in last.content or [] if p.type == "text")
    return dataclasses.replace(
        checked, messages=body.message_dicts(), media=media_limits(body, limits.media),
        template_kwargs=template_kwargs(body), add_generation_prompt=add_generation,
        echo=echo, min_prompt_tokens=around.tokens, has_media=any(kinds.values()))


def check_completion(body: CompletionRequest, limits: ServerLimits, tenant: str | None = None
                     ) -> CheckedRequest:
    """The validation pass of a completion request."""
    p = body.prompt
    if p is None or p == []:  # (vLLM's words)
        raise bad_request("prompt", "Either prompt or prompt_embeds must be provided and "
                                    "non-empty.")
    empty = next((i for i, x in enumerate(p) if isinstance(x, list) and not x), None) \
        if isinstance(p, list) else None
    if empty is not None:
        raise bad_request(f"prompt.{empty}", f"prompt.{empty}: a token-id prompt needs at "
                                             "least 1 token")
    prompts = body.prompts()
    if len(prompts) > limits.max_prompts:
        raise bad_request("prompt", f"{len(prompts)} prompts in one request; this server takes "
                                    f"at most {limits.max_prompts} (--max-pending-requests)")
    checked = _check_common(body, limits, len(prompts), tenant)
    _check_chars(sum(len(p) for p in prompts if isinstance(p, str)), limits, "prompt",
                 "prompt has")
    bad = sorted({t for p in prompts if not isinstance(p, str) for t in p
                  if t >= limits.vocab_size})
    if bad:
        raise bad_request("prompt", f"prompt token ids out of vocabulary: "
                                    f"{some([str(t) for t in bad])} (the vocabulary is "
                                    f"[0, {limits.vocab_size}))")
    return dataclasses.replace(checked, prompts=prompts)


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """Keyword arguments for the chat template: the request's, never apply_chat_template's
    own parameters."""
    kw = dict(body.chat_template_kwargs or {})
    if len(kw) > _MAX_TEMPLATE_KWARGS:
        raise bad_request("chat_template_kwargs", f"at most {_MAX_TEMPLATE_KWARGS} entries")
    for k in kw:
        if not k.isidentifier() or k in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request("chat_template_kwargs", f"chat_template_kwargs may not set "
                                                      f"{k[:40]!r}")
    if body.documents is not None:
        kw["documents"] = body.documents
    from triptych.api.tools.checks import chat_plan

    plan = chat_plan(body) if body.tools else None
    if plan is not None:  # the model's own template renders the definitions
        kw["tools"] = plan.template_tools()
    return kw


def media_limits(body: ChatCompletionRequest, base: MediaLimits) -> MediaLimits:
    """The server's media caps, lowered by the request's ``media_io_kwargs`` (a request may
    ask for fewer video frames or a lower sampling rate, never for more)."""
    kw = body.media_io_kwargs or {}
    frames, fps = base.max_video_frames, base.video_fps
    for modality, opts in kw.items():
        where = f"media_io_kwargs.{modality}"
        if modality not in ("image", "video"):
            raise bad_request("media_io_kwargs", f"unknown modality {modality[:20]!r} "
                                                 "(image, video)")
        for key, value in opts.items():
            if modality == "image" or key not in ("num_frames", "fps"):
                raise bad_request(f"{where}.{key[:40]}",
                                  f"{where} does not take {key[:40]!r}"
                                  + (" (num_frames, fps)" if modality == "video" else ""))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise bad_request(f"{where}.{key}", f"{where}.{key} must be a number")
        if "num_frames" in opts:
            n = opts["num_frames"]
            if n == -1:  # vLLM's "all frames": here, the server's cap
                n = base.max_video_frames
            if not isinstance(n, int) or n < 1 or n > base.max_video_frames:
                raise bad_request(f"{where}.num_frames",
                                  f"{where}.num_frames must be an integer in [1, "
                                  f"{base.max_video_frames}] (the server's cap, "
                                  "--max-video-frames)")
            frames = n
        if "fps" in opts:
            if not 0 < opts["fps"] <= base.video_fps:
                raise bad_request(f"{where}.fps", f"{where}.fps must be in (0, "
                                                  f"{base.video_fps}] (the server's cap, "
                                                  "--video-fps)")
            fps = float(opts["fps"])
    if (frames, fps) == (base.max_video_frames, base.video_fps):
        return base
    return dataclasses.replace(base, max_video_frames=frames, video_fps=fps)


def prompt_logprobs(body: Body, logprobs: int | None) -> int | None:
    """Top-k per prompt token: asked for, or implied by a completion's echo + logprobs (its
    logprobs then cover the echoed prompt too, as vLLM's do)."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    if isinstance(body, CompletionRequest) and body.echo and logprobs is not None:
        return logprobs
    return None


def sampling_params(checked: CheckedRequest, prompt_len: int, limits: ServerLimits
                    ) -> SamplingParams:
    """The engine's parameters for one prompt of a checked request, once its length is
    known (the output's room is what the context leaves)."""
    body = checked.body
    name, requested = body.requested_max_tokens
    room = limits.max_model_len - prompt_len
    if requested is not None and requested > room:
        raise context_error(limits.max_model_len, prompt_len, requested, checked.chat, name)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    try:
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            seed=body.seed, max_tokens=requested or room, min_tokens=body.min_tokens,
            stop=stop or None, stop_token_ids=body.stop_token_ids or None,
            ignore_eos=body.ignore_eos,
            # logprob_token_ids: those ids stand in for the top-k (vLLM)
            logprobs=0 if body.logprob_token_ids else checked.logprobs,
            logprob_token_ids=body.logprob_token_ids or None,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=checked.logit_bias,
            prompt_logprobs=prompt_logprobs(body, checked.logprobs),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None
            else body.repetition_penalty,
            min_p=body.min_p or 0.0, **checked.ngram,
            structured_outputs=checked.structured, cache_salt=checked.scope or None,
            tenant=checked.tenant)
    except ValueError as e:  # SamplingParams.verify: the same ranges, checked again
        raise APIError(400, str(e)) from None


__all__ = ["CheckedRequest", "ServerLimits", "check_chat", "check_completion",
           "media_limits", "sampling_params", "template_kwargs"]
