"""Checks of the sampling fields of a request body that need more than pydantic's ranges:
``logit_bias`` keys against the vocabulary, vLLM's ``vllm_xargs`` (the no-repeat n-gram
guard), and the context-length refusal in the words clients parse. Used by
api/request_checks.py; each refusal is a 400 naming the field.
"""
from __future__ import annotations

from typing import Any

from triptych.api.errors import APIError, bad_request
from triptych.api.protocol import ChatCompletionRequest, CompletionRequest


def some(items: list[str], most: int = 10) -> str:
    """Items for an error message: all of them, or the first ``most`` and a count."""
    more = f" (and {len(items) - most} more)" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def logit_bias(body: ChatCompletionRequest | CompletionRequest, vocab_size: int
               ) -> dict[int, float] | None:
    """``logit_bias`` with its keys as token ids, each inside the vocabulary. A refusal
    names every bad key (a client fixing one at a time would need a round trip each)."""
    if not body.logit_bias:
        return None
    out: dict[int, float] = {}
    not_ids, outside = [], []
    for key, value in body.logit_bias.items():
        k = key.strip()
        if not k.isdecimal() or not k.isascii():
            not_ids.append(repr(key[:20]))
        elif int(k) >= vocab_size:
            outside.append(str(int(k)))
        else:
            out[int(k)] = float(value)
    problems = []
    if not_ids:
        problems.append(f"keys that are not a token id: {some(not_ids)}")
    if outside:
        problems.append(f"keys outside the vocabulary [0, {vocab_size}): {some(outside)}")
    if problems:
        raise bad_request("logit_bias", "logit_bias has " + "; ".join(problems))
    return out


# vllm_xargs key -> the SamplingParams field it sets
_NGRAM_XARGS = {"ngram_size": "no_repeat_ngram_size", "window_size": "no_repeat_ngram_window",
                "whitelist_token_ids": "no_repeat_ngram_whitelist"}


_MIN_WHITELIST = 1 << 16  # ids a whitelist may hold whatever the vocabulary (repeats)


def ngram_guard(body: ChatCompletionRequest | CompletionRequest, vocab_size: int
                ) -> dict[str, Any]:
    """The no-repeat n-gram guard's SamplingParams fields from ``vllm_xargs`` (vLLM's
    names: ngram_size, window_size, whitelist_token_ids); other keys are refused by name.
    Whitelisted ids must lie inside the vocabulary; repeats are dropped, so the list the
    engine keeps holds at most the vocabulary. A list longer than twice the vocabulary
    (or 65,536) is refused by its length alone, before any walk over it: a 3 M-id list
    took P0's event loop ~0.5 s to walk, sort and quote."""
    xargs = body.vllm_xargs or {}
    unknown = sorted(set(xargs) - set(_NGRAM_XARGS))
    if unknown:
        names = some([repr(k[:40]) for k in unknown])
        raise bad_request("vllm_xargs", f"vllm_xargs key(s) {names} are not supported (this "
                                        f"server takes {', '.join(_NGRAM_XARGS)})")
    out: dict[str, Any] = {}
    for key, value in xargs.items():
        where = f"vllm_xargs.{key}"
        if key == "whitelist_token_ids":
            most = max(2 * vocab_size, _MIN_WHITELIST)
            if isinstance(value, list) and len(value) > most:  # (before a walk over it)
                raise bad_request(where, f"{where} holds {len(value)} ids; at most {most} "
                                         f"(twice the vocabulary of {vocab_size}, or "
                                         f"{_MIN_WHITELIST})")
            if not isinstance(value, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise bad_request(where, f"{where} must be a list of token ids")
            outside = sorted({t for t in value if t >= vocab_size})
            if outside:
                raise bad_request(where, f"{where} has ids outside the vocabulary [0, "
                                         f"{vocab_size}): {some([str(t) for t in outside])}")
            value = sorted(set(value))
        elif isinstance(value, bool) or not isinstance(value, int) or \
                not 0 <= value <= 2**31 - 1:
            raise bad_request(where, f"{where} must be a non-negative integer")
        out[_NGRAM_XARGS[key]] = value
    return out


def context_message(max_model_len: int, prompt_len: int, max_tokens: int | None,
                    what: str) -> str:
    """Too long for the context, worded as vLLM (and OpenAI) word it: clients parse it.
    ``max_tokens`` None: the prompt alone leaves no room for one output token."""
    head = f"This model's maximum context length is {max_model_len} tokens. "
    if max_tokens is None:
        return head + (f"However, you requested {prompt_len} tokens in the {what}, which "
                       f"leaves no room for a completion. Please reduce the length of the "
                       f"{what}.")
    return head + (f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} "
                   f"in the {what}, {max_tokens} in the completion). Please reduce the "
                   f"length of the {what} or completion.")


def context_error(max_model_len: int, prompt_len: int, max_tokens: int | None,
                  chat: bool, param: str) -> APIError:
    """``context_message`` as a 400 naming ``param``."""
    return bad_request(param, context_message(max_model_len, prompt_len, max_tokens,
                                              "messages" if chat else "prompt"))


__all__ = ["context_error", "context_message", "logit_bias", "ngram_guard", "some"]
