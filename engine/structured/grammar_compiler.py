"""GrammarCompiler: StructuredOutputsParams -> xgrammar CompiledGrammar, off the step loop.

One compiler per tokenizer (P0 has one for validation, every worker's engine core one for
decoding): its cache is keyed by the spec's canonical key, so the pair (spec, tokenizer)
names a compiled grammar. Compiles run on a small thread pool; ``submit`` starts one (or
joins the one in flight) and returns its future, ``compile`` waits for it with a bound.

    P0:      check  -> compile(spec, timeout) -> 400 naming the problem, before any work
    worker:  AddRequest -> submit(spec) -> (request waits) -> done -> admitted -> the batch
             asks compile(spec) on join: a cache hit

NOTE: compiled grammars never cross processes (xgrammar only pickles them); the spec's text
does, and each process compiles it against the same tokenizer.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from triptych.engine.structured.structured_params import StructuredOutputsParams

logger = logging.getLogger("triptych.grammar")
COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer is refused (P0) / fails (worker)
CACHE_ENTRIES = 256  # compiled grammars kept (least recently used go first)
JSON_MAX_WHITESPACE = 4  # whitespace characters allowed between JSON tokens (when free
# whitespace is on): unbounded, a weak model can pad with tabs until max_tokens


class GrammarCompiler:
    """Compile cache of one tokenizer. ``tokenizer``: an HF tokenizer; or ``load``, a
    function that loads one on first use (on the compiler's thread: a worker that never
    sees a structured request never loads it)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, *,
                 load: Callable[[], Any] | None = None, max_threads: int = 2) -> None:
        self._tokenizer, self._load = tokenizer, load
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._xgr: Any = None  # xgrammar.GrammarCompiler, made on first use
        self.num_compiles = 0
        self.num_hits = 0

    def _compiler(self) -> Any:
        with self._lock:
            if self._xgr is None:
                import xgrammar as xgr

                tok = self._tokenizer if self._load is None else self._load()
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop)
                self._xgr = xgr.GrammarCompiler(info, max_threads=1)
            return self._xgr

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compile of ``spec``: cached, in flight, or started now."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:  # (an invalid spec's error is cached too: same answer)
                self._cache.move_to_end(key)
                self.num_hits += 1
                return fut
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            self.num_compiles += 1
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return fut

    def compile(self, spec: StructuredOutputsParams, timeout: float = COMPILE_TIMEOUT_S
                ) -> Any:
        """The compiled grammar (waits at most ``timeout``). Raises ValueError naming the
        problem: an invalid schema / regex / grammar, or a compile that took too long."""
        fut = self.submit(spec)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise ValueError(f"the {spec.kind} constraint took longer than {timeout:g} s to "
                             "compile; use a smaller schema or grammar") from None

    def _compile(self, key: tuple[str, str, bool, bool]) -> Any:
        return compile_key(self._compiler(), key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compile_key(comp: Any, key: tuple[str, str, bool, bool]) -> Any:
    """``key`` (StructuredOutputsParams.key) compiled by ``comp`` (an
    xgrammar.GrammarCompiler). Raises ValueError naming the problem in the spec."""
    kind, text, any_ws, extra_props = key
    try:
        if kind == "json":
            return comp.compile_json_schema(text, any_whitespace=any_ws,
                                            strict_mode=not extra_props,
                                            max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "json_object":
            return comp.compile_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                            strict_mode=False,
                                            max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "regex":
            return comp.compile_regex(text)
        if kind == "choice":
            alts = " | ".join(json.dumps(c) for c in json.loads(text))
            return comp.compile_grammar(f"root ::= {alts}")
        if kind == "grammar":
            return comp.compile_grammar(text)
        return comp.compile_structural_tag(*_structural_tag_args(text))
    except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError, ValueError,
        # InvalidJSONError...: each one is the spec's fault and names it)
        # (xgrammar's C++ checks prefix "[time] file:line: Check failed: (...) is false:")
        msg = re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", "",
                     " ".join(str(e).strip().splitlines()))
        raise ValueError(f"invalid {kind} constraint: "
                         f"{msg[:500] or type(e).__name__}") from None


def _structural_tag_args(text: str) -> tuple:
    """vLLM's legacy form ({"structures": [{begin, schema, end}], "triggers": [...]}) as
    xgrammar's (tags, triggers); anything else goes to xgrammar as given."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if isinstance(obj, dict) and "structures" in obj:
        import xgrammar as xgr

        tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                      end=s["end"]) for s in obj["structures"]]
        return tags, obj.get("triggers", [])
    return (text,)
