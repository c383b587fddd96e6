"""SamplingParams: vLLM's field names, so existing scripts and configs carry over."""
from __future__ import annotations

import math
from typing import Any

import msgspec
from triptych.engine.structured.structured_params import StructuredOutputsParams

_INT64 = 2**63 - 1
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens for one request. Validated once, in ``verify()``."""

    n: int = 1  # completions per prompt (each sampled independently)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    seed: int | None = None  # per-request generator seed: same seed, same tokens
    max_tokens: int | None = 16  # output tokens at most; None = up to max_model_len
    min_tokens: int = 0  # EOS / stop token ids ignored until this many tokens
    stop: list[str] | None = None  # stop strings (not included in the text)
    stop_token_ids: list[int] | None = None  # extra token ids that end the request
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: int | None = None  # top-k logprobs per output token (plus the sampled one)
    # vLLM's logprob_token_ids: these ids' logprobs at every output token (plus the sampled
    # one), whatever their rank; offline, a numeric ``logprobs`` must then equal their count
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the prompt's
    # own); such a prompt is computed in full (its prefix-cache hits are not used)
    skip_special_tokens: bool = True  # drop special tokens from the output text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Penalties (engine/sample/penalties.py): applied after logit_bias, before temperature.
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from every token already output
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per earlier output of the token
    repetition_penalty: float = 1.0  # > 0: logits of prompt and output tokens divided (> 0)
    # or multiplied (< 0) by it; 1 = off
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the top token's prob
    no_repeat_ngram_size: int = 0  # > 0: no n-gram of this size occurs twice in the output
    no_repeat_ngram_window: int = 0  # only n-grams starting in the last this-many output
    # tokens count (0: the whole output)
    no_repeat_ngram_whitelist: list[int] | None = None  # token ids the guard never bans
    # vLLM's extension dict: the n-gram guard's knobs under vLLM's names (ngram_size,
    # window_size, whitelist_token_ids), as DeepSeek-OCR's recipes pass them
    extra_args: dict[str, Any] | None = None
    # Prefix-cache scope (vLLM's request-level ``cache_salt``, plus the tenant on a server
    # with API keys): salts the first block's hash, so only requests with the same value
    # share cached KV. The server sets it; None = the shared cache.
    cache_salt: str | None = None
    # Whose share of a step this request runs in (engine/tenant_share.py): the server sets
    # the API key's tenant; None = the one anonymous tenant (offline, or a server without keys)
    tenant: str | None = None
    # Structured output (engine/structured/grammar.py): the output must match this schema / regex /
    # choice / grammar; None = unconstrained
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._take_extra_args()
        self.verify()

    def _take_extra_args(self) -> None:
        """Move vLLM's n-gram keys from ``extra_args`` into the fields (idempotent: the
        wire decodes a struct through __post_init__ again)."""
        extra = self.extra_args
        if not extra:
            return
        if not isinstance(extra, dict):
            raise ValueError("extra_args must be a dict")
        unknown = sorted(set(extra) - set(EXTRA_ARGS))
        if unknown:
            raise ValueError(f"extra_args: unknown key(s) {unknown}; this engine takes "
                             f"{sorted(EXTRA_ARGS)} (the no-repeat n-gram guard)")
        for key, field in EXTRA_ARGS.items():
            if key in extra:
                v = extra[key]
                if field == "no_repeat_ngram_whitelist":
                    v = sorted(v) if isinstance(v, (set, frozenset, list, tuple)) else v
                    if not isinstance(v, list) or not all(
                            isinstance(t, int) and not isinstance(t, bool) for t in v):
                        raise ValueError(f"extra_args.{key} must be a list of token ids")
                elif isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(f"extra_args.{key} must be an integer")
                setattr(self, field, v)
        self.extra_args = None

    def verify(self) -> None:
        # NOTE: NaN passes every `<` check; a NaN temperature used to reach the sampler and
        # fail the whole batch. Every float must be finite, every int fit the wire (int64).
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs",
                     "prompt_logprobs", "no_repeat_ngram_size", "no_repeat_ngram_window"):
            v = getattr(self, name)
            if v is not None and not -_INT64 - 1 <= v <= _INT64:
                raise ValueError(f"{name} is out of range")
        if any(not 0 <= t <= _INT64 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        self._check_logprob_token_ids()
        for tid, bias in (self.logit_bias or {}).items():
            if tid < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.no_repeat_ngram_size < 0 or self.no_repeat_ngram_window < 0:
            raise ValueError("no_repeat_ngram_size and no_repeat_ngram_window must be "
                             "non-negative (0: off / the whole output)")
        if any(not 0 <= t <= _INT64 for t in self.no_repeat_ngram_whitelist or []):
            raise ValueError("no_repeat_ngram_whitelist must hold non-negative token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError("cache_salt must be a non-empty string if provided")

    def _check_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not ids or len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids must be a list of 1 to "
                             f"{MAX_LOGPROB_TOKEN_IDS} token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT64
               for t in ids):
            raise ValueError("logprob_token_ids must hold non-negative token ids")
        if self.logprobs is None:
            self.logprobs = 0  # the ids' logprobs ride on the logprobs path
        elif self.logprobs not in (0, len(ids)):
            raise ValueError(f"logprobs ({self.logprobs}) must equal the number of "
                             f"logprob_token_ids ({len(ids)}) when both are given")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalised(self) -> bool:
        """Whether this request needs token history at sampling time (engine/sample/penalties.py);
        requests without it cost the batch nothing."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0)


# vLLM's extra_args keys for the no-repeat n-gram guard -> our fields
EXTRA_ARGS = {"ngram_size": "no_repeat_ngram_size", "window_size": "no_repeat_ngram_window",
              "whitelist_token_ids": "no_repeat_ngram_whitelist"}
