"""Checks that span fields, need the model's vocabulary or name a server flag, run before any
work is done for a request (no media fetched, nothing tokenized), and the mapping from a
request body to the engine's SamplingParams.

Each refusal is a 400 naming the field (``param``) and the problem. Features the engine does
not have are refused by name rather than silently ignored: a vLLM client that sends
``logits_processors`` learns that it did not get them.
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
from triptych.api.tools.checks import check_tools
from triptych.api.tools.plan import ToolSettings
from triptych.engine.beam_search import MAX_BEAM_WIDTH
from triptych.engine.sampling_params import SamplingParams

# apply_chat_template's own parameters (and the template's conversation variables) may not
# come in through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs"}
_MAX_TEMPLATE_KWARGS = 32


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
    tools: ToolSettings = field(default_factory=ToolSettings)  # --tool-call-parser, ...

    @property
    def prompt_chars(self) -> int:
        return self.max_prompt_chars or 20 * self.max_model_len


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


def check_common(body: ChatCompletionRequest | CompletionRequest, limits: ServerLimits
                 ) -> None:
    for name, (asks, why) in _UNSUPPORTED.items():
        if name in type(body).model_fields and asks(getattr(body, name)):
            raise bad_request(name, why)
    if body.n > limits.max_n:
        raise bad_request("n", f"n is {body.n} but this server allows at most {limits.max_n} "
                               "completions per request (--max-n)")
    if body.best_of is not None:
        if body.best_of > limits.max_n:
            raise bad_request("best_of", f"best_of is {body.best_of} but this server allows at "
                                         f"most {limits.max_n} (--max-n)")
        if body.best_of != body.n:
            raise bad_request("best_of", "best_of different from n is not supported")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options can only be given with stream=true")
    if not math.isfinite(body.length_penalty):
        raise bad_request("length_penalty", "length_penalty must be a finite number")
    if body.use_beam_search and body.n > MAX_BEAM_WIDTH:
        raise bad_request("n", f"n is the beam width with use_beam_search: at most "
                               f"{MAX_BEAM_WIDTH}")
    name, max_tokens = body.requested_max_tokens
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"min_tokens ({body.min_tokens}) is larger than "
                                        f"{name} ({max_tokens})")
    t = body.truncate_prompt_tokens
    if t is not None and t > limits.max_model_len:
        raise bad_request("truncate_prompt_tokens", f"truncate_prompt_tokens is {t}, larger "
                                                    f"than max_model_len ({limits.max_model_len})")
    for tid in body.stop_token_ids or []:
        if tid >= limits.vocab_size:
            raise bad_request("stop_token_ids", f"stop token id {tid} is outside the "
                                                f"vocabulary [0, {limits.vocab_size})")
    logit_bias(body, limits.vocab_size)
    ngram_guard(body)
    _logprob_token_ids(body, limits.vocab_size)


def _logprob_token_ids(body: ChatCompletionRequest | CompletionRequest, vocab: int) -> None:
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


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p.text) for p in content or [] if getattr(p, "type", "") == "text")


def _check_chars(n: int, limits: ServerLimits) -> None:
    # NOTE: before tokenization, so a huge prompt costs a length check, not seconds of BPE.
    if n > limits.prompt_chars:
        raise bad_request("prompt", f"the prompt has {n} characters; this server takes at "
                                    f"most {limits.prompt_chars} (--max-prompt-chars)")


def check_chat(body: ChatCompletionRequest, limits: ServerLimits) -> None:
    check_common(body, limits)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs=true")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message", "continue_final_message and "
                                                    "add_generation_prompt cannot both be true")
    kinds = {"image": 0, "video": 0}
    chars = check_tools(body, limits.tools, limits.prompt_chars, limits.max_structured_depth)
    for i, m in enumerate(body.messages):
        if m.content is None and not (m.role == "assistant" and getattr(m, "tool_calls", None)):
            raise bad_request(f"messages.{i}.content", f"a {m.role} message needs content "
                                                       "(a string or a list of parts)")
        chars += _text_chars(m.content)
        for p in m.content if isinstance(m.content, list) else []:
            if p.type != "text":
                kinds[p.type[:5]] += 1
    chars += sum(len(v) for d in body.documents or [] for v in d.values())
    if chars > limits.prompt_chars:
        raise bad_request("messages", f"the messages hold {chars} characters; this server "
                                      f"takes at most {limits.prompt_chars} (--max-prompt-chars)")
    for kind, count in kinds.items():  # before any media is fetched
        if count > limits.limit_mm_per_prompt.get(kind, 0):
            raise bad_request("messages", f"{count} {kind}(s) in the prompt, but "
                                          f"limit_mm_per_prompt allows "
                                          f"{limits.limit_mm_per_prompt.get(kind, 0)} {kind}(s)")
    if body.continue_final_message:
        last = body.messages[-1].content
        if isinstance(last, list) and (not last or last[-1].type != "text"):
            raise bad_request("continue_final_message", "the final message must end with "
                                                        "text to be continued")
    template_kwargs(body)
    media_limits(body, limits.media)


def check_completion(body: CompletionRequest, limits: ServerLimits) -> None:
    p = body.prompt
    if p is None or p == []:  # (vLLM's words)
        raise bad_request("prompt", "Either prompt or prompt_embeds must be provided and "
                                    "non-empty.")
    empty = next((i for i, x in enumerate(p) if isinstance(x, list) and not x), None) \
        if isinstance(p, list) else None
    if empty is not None:
        raise bad_request(f"prompt.{empty}", f"prompt.{empty}: a token-id prompt needs at "
                                             "least 1 token")
    check_common(body, limits)
    prompts = body.prompts()
    if len(prompts) > limits.max_prompts:
        raise bad_request("prompt", f"{len(prompts)} prompts in one request; this server takes "
                                    f"at most {limits.max_prompts} (--max-pending-requests)")
    _check_chars(sum(len(p) for p in prompts if isinstance(p, str)), limits)
    bad = sorted({t for p in prompts if not isinstance(p, str) for t in p
                  if t >= limits.vocab_size})
    if bad:
        raise bad_request("prompt", f"prompt token ids out of vocabulary: "
                                    f"{some([str(t) for t in bad])} (the vocabulary is "
                                    f"[0, {limits.vocab_size}))")


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


def prompt_logprobs(body: ChatCompletionRequest | CompletionRequest, logprobs: int | None
                    ) -> int | None:
    """Top-k per prompt token: asked for, or implied by a completion's echo + logprobs (its
    logprobs then cover the echoed prompt too, as vLLM's do)."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    if isinstance(body, CompletionRequest) and body.echo and logprobs is not None:
        return logprobs
    return None


def sampling_params(body: ChatCompletionRequest | CompletionRequest, prompt_len: int,
                    limits: ServerLimits, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for one prompt of this request."""
    name, requested = body.requested_max_tokens
    room = limits.max_model_len - prompt_len
    if requested is not None and requested > room:
        raise context_error(limits.max_model_len, prompt_len, requested,
                            isinstance(body, ChatCompletionRequest), name)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    try:
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            seed=body.seed, max_tokens=requested or room, min_tokens=body.min_tokens,
            stop=stop or None, stop_token_ids=body.stop_token_ids or None,
            ignore_eos=body.ignore_eos,
            # logprob_token_ids: those ids stand in for the top-k (vLLM)
            logprobs=0 if body.logprob_token_ids else logprobs,
            logprob_token_ids=body.logprob_token_ids or None,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias(body, limits.vocab_size),
            prompt_logprobs=prompt_logprobs(body, logprobs),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None
            else body.repetition_penalty,
            min_p=body.min_p or 0.0, **ngram_guard(body),
            structured_outputs=structured_outputs(body))
    except ValueError as e:  # SamplingParams.verify: the same ranges, checked again
        raise APIError(400, str(e)) from None


__all__ = ["ServerLimits", "check_chat", "check_completion", "context_error", "media_limits",
           "sampling_params", "template_kwargs"]
