"""Engine deltas -> OpenAI response shapes (chat / completions, whole and SSE chunks).

Pure functions of what the engine sent; the server (api/server.py) owns the flow.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from triptych.engine import wire

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
MAX_MESSAGE_CHARS = 500


def safe_message(message: str) -> str:
    """Error text for a client: bounded, with anything address-like masked (defence in
    depth: the layers below already word their errors for clients)."""
    return _ADDRESS.sub("0x...", message)[:MAX_MESSAGE_CHARS]


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": safe_message(message), "type": type_, "param": param,
                      "code": status}}


@dataclass
class Choice:
    """One completion, accumulated from deltas (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, c: wire.CompletionDelta) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.finish_reason = c.finish_reason or self.finish_reason


def usage(d: wire.RequestDelta, num_output_tokens: int) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": d.num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


class Formatter:
    """Builds response objects for one served model; decodes tokens for logprobs."""

    def __init__(self, tokenizer: Any, model: str) -> None:
        self.tokenizer, self.model = tokenizer, model

    def _tok(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], k: int) -> dict:
        # Each dict holds the top-k ids plus the sampled one (which may be outside the top-k).
        content = []
        for tid, d in zip(token_ids, lps):
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            tok = self._tok(tid)
            content.append({"token": tok, "logprob": d[tid], "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": (s := self._tok(t)), "logprob": v,
                                              "bytes": list(s.encode())} for t, v in top]})
        return {"content": content}

    def completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], k: int,
                            offset: int = 0) -> dict:
        tokens = [self._tok(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [d[t] for t, d in zip(token_ids, lps)],
                "top_logprobs": [{self._tok(t): v for t, v in
                                  sorted(d.items(), key=lambda kv: -kv[1])[:k]} for d in lps],
                "text_offset": offsets}

    def whole(self, rid: str, created: int, chat: bool, choices: list[Choice], k: int | None,
              last: wire.RequestDelta) -> dict:
        out = []
        for i, c in enumerate(choices):
            if chat:
                lp = self.chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None
                out.append({"index": i, "message": {"role": "assistant", "content": c.text},
                            "finish_reason": c.finish_reason, "logprobs": lp})
            else:
                lp = (self.completion_logprobs(c.token_ids, c.logprobs, k)
                      if k is not None else None)
                out.append({"index": i, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": lp})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.model, "choices": out,
                "usage": usage(last, sum(len(c.token_ids) for c in choices))}

    def chunk_choices(self, d: wire.RequestDelta, chat: bool, k: int | None,
                      offsets: list[int]) -> list[dict]:
        choices = []
        for c in d.completions:
            ch: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            if chat:
                ch["delta"] = {"content": c.text} if c.text else {}
                ch["logprobs"] = (self.chat_logprobs(c.token_ids, c.logprobs or [], k)
                                  if k is not None else None)
            else:
                ch["text"] = c.text
                ch["logprobs"] = (self.completion_logprobs(c.token_ids, c.logprobs or [], k,
                                                           offsets[c.index])
                                  if k is not None else None)
                offsets[c.index] += len(c.text)
            choices.append(ch)
        return choices

    def sse(self, rid: str, created: int, chat: bool, choices: list[dict],
            usage_: dict | None = None) -> str:
        obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
               "created": created, "model": self.model, "choices": choices}
        if usage_ is not None:
            obj["usage"] = usage_
        return f"data: {json.dumps(obj)}\n\n"

    @staticmethod
    def sse_error(status: int, message: str, type_: str) -> str:
        return f"data: {json.dumps(error_body(status, message, type_))}\n\n"
