"""Engine deltas -> OpenAI response shapes (chat / completions, whole bodies and SSE chunks),
with vLLM's extensions (``stop_reason``, ``token_ids`` / ``prompt_token_ids``, usage cache
accounting). Pure functions of what the engine sent; the flow is in api/serving.py.

Choice ``index`` is ``prompt_index * n + completion_index`` (several prompts in one
/v1/completions request are indexed in order, as vLLM and OpenAI do). Streams carry one
choice per chunk, each with its own ``finish_reason``.
"""
from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from triptych.api.logprobs_json import ItemPieces
from triptych.router.detokenizer import token_text, token_texts
from triptych.worker import wire

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
MAX_MESSAGE_CHARS = 500
PIECE_ITEMS = 64  # rendered logprobs items per piece of a whole response (~0.1-0.25 MB at
# 20 alternatives a token)
# the JSON of whole responses, as starlette's JSONResponse writes it
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False,
                           separators=(",", ":"))


def safe_message(message: str) -> str:
    """Error text for a client: bounded, with anything address-like masked (defence in
    depth: the layers below already word their errors for clients)."""
    return _ADDRESS.sub("0x...", message)[:MAX_MESSAGE_CHARS]


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": safe_message(message), "type": type_, "param": param,
                      "code": status}}


@dataclass
class Choice:
    """One completion, accumulated from deltas (non-streaming responses). Its logprobs are
    kept as JSON text, rendered delta by delta as they arrive (``Formatter.add``): a whole
    answer's are then joined, not built. n=16 x 1,500 tokens x 20 alternatives is ~35 MB of
    JSON; built in one go from Python dicts it held P0's event loop for seconds and took
    ~250 MB, here it costs a few ms between engine steps and its own size in memory."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the logprobs object's lists, as JSON items: chat "content"; completions "tokens",
    # "token_logprobs", "top_logprobs", "text_offset" (parallel)
    lp_items: dict[str, list[str]] = field(default_factory=dict)
    text_chars: int = 0  # completions: characters of the tokens so far (text_offset)

    def add(self, c: wire.CompletionDelta) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        self.finish_reason = c.finish_reason or self.finish_reason
        self.stop_reason = c.stop_reason if c.stop_reason is not None else self.stop_reason

    def logprobs_json(self, head: dict[str, list] | None = None) -> str:
        """The logprobs object as JSON; ``head``: lists put first (the echoed prompt's)."""
        return "".join(self.logprobs_pieces(head))

    def logprobs_pieces(self, head: dict[str, list] | None = None) -> Iterator[str]:
        """``logprobs_json`` in pieces of at most PIECE_ITEMS rendered items each."""
        for j, (key, items) in enumerate(self.lp_items.items()):
            first = _dumps(head[key])[1:-1] if head else ""
            yield ("{" if j == 0 else ",") + f"{_dumps(key)}:[" + first
            for k in range(0, len(items), PIECE_ITEMS):
                chunk = ",".join(items[k:k + PIECE_ITEMS])
                yield ("," + chunk) if first or k else chunk
            yield "]"
        if not self.lp_items:
            yield "{"
        yield "}"


@dataclass
class PromptInfo:
    """What the response says about one prompt of the request."""

    token_ids: list[int]
    num_cached_tokens: int = 0
    echo: str = ""  # text put before each completion's (echo)
    mm_tokens: dict[str, int] = field(default_factory=dict)  # placeholder tokens by modality
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (first: None)


@dataclass
class Shape:
    """How one request wants its response written."""

    chat: bool
    model: str
    n: int = 1
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: "token_id:123"
    token_ids: bool = False  # return_token_ids
    block_size: int = 16  # KV block: what the prefix cache can hold (created_cache_tokens)
    prefix_caching: bool = True
    prompt_logprobs: bool = False  # the response carries prompt_logprobs (vLLM's field)
    tools: Any = None  # chat: the request's ToolPlan (api/tools/), read back as tool_calls


class Formatter:
    def __init__(self, tokenizer: Any, shape: Shape, rid: str, created: int) -> None:
        self.tok, self.s, self.rid, self.created = tokenizer, shape, rid, created
        self._tool_text: dict[int, tuple[Any, str]] = {}  # streamed choice -> (reader, text)
        self._pieces: ItemPieces | None = None  # chat logprobs' JSON per token id
        self._texts: dict[int, str] | None = None  # the tokenizer's token texts

    def _tool_delta(self, index: int, c: wire.CompletionDelta) -> tuple[dict, str | None]:
        """A streamed chat choice's delta and finish reason with tool calls read out of
        its text (api/tools/reader.py)."""
        from triptych.api.tools.reader import ToolReader

        reader, text = self._tool_text.get(index) or (ToolReader(self.s.tools), "")
        text += c.text
        self._tool_text[index] = (reader, text)
        done = c.finish_reason is not None
        return reader.deltas(text, done), reader.finish_reason(c.finish_reason) if done \
            else None

    # -- pieces ---------------------------------------------------------------------------
    def _token(self, tid: int) -> str:
        if self.s.tokens_as_ids:
            return f"token_id:{tid}"
        if self._texts is None:
            self._texts = token_texts(self.tok)
        return token_text(self.tok, tid, self._texts)

    def chat_logprobs(self, ids: list[int], lps: list[dict[int, float]]) -> dict:
        # Each dict holds the top-k ids plus the sampled one (which may be outside them).
        k, content = self.s.logprobs or 0, []
        for tid, d in zip(ids, lps):
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            tok = self._token(tid)
            content.append({"token": tok, "logprob": d[tid], "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": (s := self._token(t)), "logprob": v,
                                              "bytes": list(s.encode())} for t, v in top]})
        return {"content": content}

    def completion_logprobs(self, ids: list[int], lps: list[dict[int, float]], offset: int
                            ) -> dict:
        k = self.s.logprobs or 0
        tokens = [self._token(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [d[t] for t, d in zip(ids, lps)],
                "top_logprobs": [self._top(d, k, t) for t, d in zip(ids, lps)],
                "text_offset": offsets}

    def prompt_logprobs(self, lps: list[dict[int, float] | None] | None) -> list | None:
        """vLLM's prompt_logprobs: per prompt position None (the first) or {token id:
        {logprob, rank, decoded_token}}; rank among the returned entries."""
        if lps is None:
            return None
        return [None if d is None else {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": self._token(t)}
            for r, (t, v) in enumerate(sorted(d.items(), key=lambda kv: -kv[1]))} for d in lps]

    def echo_logprobs(self, p: PromptInfo) -> dict:
        """The completions logprobs of an echoed prompt (its first token has none)."""
        k, lps = self.s.logprobs or 0, p.prompt_logprobs or []
        ids = p.token_ids
        tokens = [self._token(t) for t in ids]
        offsets, off = [], 0
        for tok in tokens:
            offsets.append(off)
            off += len(tok)
        return {"tokens": tokens,
                "token_logprobs": [None] + [d[t] if d else None for t, d in zip(ids[1:], lps[1:])],
                "top_logprobs": [None] + [self._top(d, k, t) if d else None
                                          for t, d in zip(ids[1:], lps[1:])],
                "text_offset": offsets}

    def _top(self, d: dict[int, float], k: int, chosen: int) -> dict[str, float]:
        """The completions format's top_logprobs of one position: the chosen token first,
        then the k likeliest (vLLM's and OpenAI's k + 1 entries at most; logprobs=0 gives
        the chosen token alone)."""
        # Two ids can decode to the same text (partial UTF-8 -> U+FFFD): keep the first.
        out: dict[str, float] = {self._token(chosen): d[chosen]}
        for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:k]:
            out.setdefault(self._token(t), v)
        return out

    def usage(self, prompts: list[PromptInfo], completion_tokens: int) -> dict:
        prompt = sum(len(p.token_ids) for p in prompts)
        cached = sum(p.num_cached_tokens for p in prompts)
        bs = self.s.block_size
        # Full prompt blocks go to the prefix cache; those not found there were created.
        created = sum(max(0, len(p.token_ids) // bs * bs - p.num_cached_tokens)
                      for p in prompts) if self.s.prefix_caching else 0
        details: dict[str, Any] = {"cached_tokens": cached, "created_cache_tokens": created}
        mm: dict[str, int] = {}
        for p in prompts:
            for kind, count in p.mm_tokens.items():
                mm[kind] = mm.get(kind, 0) + count
        details["multimodal_tokens"] = mm or None
        # cache_read_input_tokens: the prefix-cache hits again, under the name vLLM's
        # Anthropic-style usage gives them (clients that bill cache reads look for it).
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens, "prompt_tokens_details": details,
                "cache_read_input_tokens": cached}

    # -- whole responses ------------------------------------------------------------------
    def add(self, choice: Choice, c: wire.CompletionDelta, prompt: PromptInfo) -> None:
        """One delta into ``choice``, its logprobs rendered now (see Choice)."""
        choice.add(c)
        if self.s.logprobs is None:
            return
        if self.s.chat:  # straight to JSON text (api/logprobs_json.py)
            items = choice.lp_items.setdefault("content", [])
            if c.token_ids and c.logprobs:
                if self._pieces is None:
                    self._pieces = ItemPieces(self.tok, self.s.tokens_as_ids, self._token)
                items.append(self._pieces.content(c.token_ids, c.logprobs, self.s.logprobs))
            return
        lp = self.completion_logprobs(c.token_ids, c.logprobs or [],
                                      len(prompt.echo) + choice.text_chars)
        choice.text_chars += sum(len(t) for t in lp["tokens"])
        for key, values in lp.items():
            items = choice.lp_items.setdefault(key, [])
            if values:
                items.append(_dumps(values)[1:-1])

    def whole(self, prompts: list[PromptInfo], choices: list[Choice]) -> str:
        """The whole response's JSON text (its logprobs joined from what ``add`` rendered)."""
        return "".join(self.whole_pieces(prompts, choices))

    def whole_pieces(self, prompts: list[PromptInfo], choices: list[Choice]) -> Iterator[str]:
        """``whole`` in pieces, in order: the response around each choice's logprobs, and
        those in pieces of rendered items. Never the whole text at once: n=16 x 1,500
        tokens x 20 alternatives spliced into one string took ~340 ms of P0's event loop
        (a copy of the growing text per choice); served piece by piece it takes none."""
        nonce = secrets.token_hex(8)  # marks where each choice's logprobs JSON goes
        spliced: list[tuple[str, Choice, dict[str, list] | None]] = []
        out: list[dict[str, Any]] = []
        for i, c in enumerate(choices):
            p = prompts[i // self.s.n]
            ch: dict[str, Any] = {"index": i}
            lp = None
            if self.s.logprobs is not None:
                # the echoed prompt's tokens come first (completions with echo + logprobs)
                head = self.echo_logprobs(p) if not self.s.chat and p.echo and \
                    p.prompt_logprobs is not None else None
                if not c.lp_items:  # (no token arrived)
                    keys = ("content",) if self.s.chat else \
                        ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                    c.lp_items = {k: [] for k in keys}
                lp = f"\0{nonce}:{i}\0"
                spliced.append((_dumps(lp), c, head))
            if self.s.chat and self.s.tools is not None:  # tool calls read out (api/tools/)
                from triptych.api.tools.reader import ToolReader

                ch["message"], c.finish_reason = ToolReader(self.s.tools).message(
                    c.text, c.finish_reason)
                if p.echo and isinstance(ch["message"].get("content"), str):
                    ch["message"]["content"] = p.echo + ch["message"]["content"]
            if self.s.chat:
                ch.setdefault("message", {"role": "assistant", "content": p.echo + c.text})
                ch["logprobs"] = lp
            else:
                ch["text"] = p.echo + c.text
                ch["logprobs"] = lp
                if self.s.prompt_logprobs:
                    ch["prompt_logprobs"] = self.prompt_logprobs(p.prompt_logprobs)
                if self.s.token_ids:
                    ch["prompt_token_ids"] = p.token_ids
            ch["finish_reason"], ch["stop_reason"] = c.finish_reason, c.stop_reason
            if self.s.token_ids:
                ch["token_ids"] = c.token_ids
            out.append(ch)
        body = {"id": self.rid, "object": "chat.completion" if self.s.chat else "text_completion",
                "created": self.created, "model": self.s.model, "choices": out,
                "usage": self.usage(prompts, sum(len(c.token_ids) for c in choices))}
        if self.s.chat and self.s.token_ids:
            body["prompt_token_ids"] = prompts[0].token_ids
        if self.s.chat and self.s.prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs(prompts[0].prompt_logprobs)
        text, pos = _dumps(body), 0
        for mark, c, head in spliced:  # in the order the choices stand in the text
            at = text.index(mark, pos)
            yield text[pos:at]
            yield from c.logprobs_pieces(head)
            pos = at + len(mark)
        yield text[pos:]

    # -- streams --------------------------------------------------------------------------
    def sse(self, choices: list[dict], usage: dict | None = None, **extra: Any) -> str:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.s.chat
               else "text_completion", "created": self.created, "model": self.s.model,
               "choices": choices, **extra}
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n"

    def opening(self, prompts: list[PromptInfo]) -> list[dict]:
        """Chat streams open each choice with its role (and the echoed text, if any), one
        choice per chunk, logprobs null as vLLM's. Completion streams have no opening: a
        choice's first chunk carries its echo (``chunk_choice(first=...)``)."""
        out: list[dict] = []
        for i in range(len(prompts) * self.s.n if self.s.chat else 0):
            out.append({"index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None})
            if (p := prompts[i // self.s.n]).echo:
                out.append({"index": i, "delta": {"content": p.echo}, "logprobs": None,
                            "finish_reason": None})
        return out

    def chunk_choice(self, index: int, c: wire.CompletionDelta, offset: int,
                     first: PromptInfo | None = None) -> dict:
        """One completion's delta as a stream choice; ``offset``: its text so far (the
        completions format's text_offset). ``first`` (completions, a choice's first chunk):
        its prompt, whose echo (text and, with logprobs, the prompt's logprobs) comes
        first and whose ids ride along (return_token_ids), as in vLLM's first chunk. So
        with logprobs asked for, every completions chunk carries a logprobs object."""
        ch: dict[str, Any] = {"index": index}
        reason = c.finish_reason
        if self.s.chat and self.s.tools is not None:
            ch["delta"], reason = self._tool_delta(index, c)
        elif self.s.chat:
            ch["delta"] = {"content": c.text} if c.text else {}
        if self.s.chat:
            ch["logprobs"] = (self.chat_logprobs(c.token_ids, c.logprobs or [])
                              if self.s.logprobs is not None else None)
        else:
            echo = first.echo if first is not None else ""
            ch["text"] = echo + c.text
            ch["logprobs"] = None
            if self.s.logprobs is not None:
                lp = self.completion_logprobs(c.token_ids, c.logprobs or [], offset + len(echo))
                if echo and first is not None and first.prompt_logprobs is not None:
                    head = self.echo_logprobs(first)  # the echoed prompt's tokens first
                    lp = {key: head[key] + lp[key] for key in head}
                ch["logprobs"] = lp
            if first is not None and self.s.token_ids:
                ch["prompt_token_ids"] = first.token_ids
        ch["finish_reason"], ch["stop_reason"] = reason, c.stop_reason
        if self.s.token_ids:
            ch["token_ids"] = c.token_ids
        return ch

    @staticmethod
    def sse_error(status: int, message: str, type_: str) -> str:
        return f"data: {json.dumps(error_body(status, message, type_))}\n\n"


__all__ = ["Choice", "Formatter", "PromptInfo", "Shape", "error_body", "safe_message"]
