"""SamplingParams: vLLM's field names, so existing scripts and configs carry over."""
from __future__ import annotations

import math

import msgspec

_INT64 = 2**63 - 1


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
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the prompt's
    # own); such a prompt is computed in full (its prefix-cache hits are not used)
    skip_special_tokens: bool = True  # drop special tokens from the output text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.verify()

    def verify(self) -> None:
        # NOTE: NaN passes every `<` check; a NaN temperature used to reach the sampler and
        # fail the whole batch. Every float must be finite, every int fit the wire (int64).
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs",
                     "prompt_logprobs"):
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
        for tid, bias in (self.logit_bias or {}).items():
            if tid < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
