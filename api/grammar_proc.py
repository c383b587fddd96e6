"""A compile process of P0's grammar check (api/grammar_check.py): compiles one spec at a
time and answers whether it is a usable constraint. It exists so a compile can really be
abandoned: P0 kills the process when a compile overruns its time (a thread cannot be
stopped), and a crash inside the compiler ends this process, not P0.

    stdin:  frame(Start), then frame(Job) ...      (frame: 4-byte big-endian length + msgpack)
    stdout: frame(Verdict) once ready, then one per Job

Nothing here is pickled; the tokenizer arrives as xgrammar's own JSON. The process dies
with its parent (PR_SET_PDEATHSIG) and on end of input.
"""
from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
from typing import BinaryIO

import msgspec

MAX_FRAME = 256 << 20  # a tokenizer's JSON (150k tokens) is a few MB


class Start(msgspec.Struct):
    tokenizer_info: str  # xgrammar.TokenizerInfo.serialize_json()


class Job(msgspec.Struct):
    key: tuple[str, str, bool, bool]  # StructuredOutputsParams.key


class Verdict(msgspec.Struct):
    error: str | None = None  # None: the spec compiles and can start an output


def write_frame(out: BinaryIO, obj: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(obj)
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO, kind: type) -> msgspec.Struct | None:
    """The next frame as ``kind``, or None at end of input."""
    head = inp.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes")
    return msgspec.msgpack.decode(inp.read(n), type=kind)


def verdict(comp: object, vocab_size: int, key: tuple[str, str, bool, bool]) -> Verdict:
    """Compile ``key``; a grammar whose first token has no allowed value (``root ::= root``:
    its language is empty) is refused here rather than failing a batch later."""
    import xgrammar as xgr
    from triptych.engine.structured.grammar_compiler import compile_key

    try:
        grammar = compile_key(comp, key)
    except ValueError as e:
        return Verdict(str(e))
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not matcher.is_terminated() and not bool(bitmask.any()):
        return Verdict(f"invalid {key[0]} constraint: it matches no output (no token can "
                       "start it: its language is empty)")
    return Verdict()


def child_pipes() -> tuple[BinaryIO, BinaryIO]:
    """A helper process's setup (this one's and api/prep_proc.py's): it dies with its
    parent (PR_SET_PDEATHSIG), and returns (frames in, frames out). NOTE: frames go to a
    private copy of stdout; fd 1 becomes stderr, so anything a library prints cannot
    corrupt them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: end of input still stops us
        pass
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return sys.stdin.buffer, out


def main() -> int:
    inp, out = child_pipes()
    start = read_frame(inp, Start)
    if start is None:
        return 0
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(start.tokenizer_info)
    # one compile at a time, nothing cached here (P0 keeps the verdicts)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(out, Verdict())
    while (job := read_frame(inp, Job)) is not None:
        write_frame(out, verdict(comp, info.vocab_size, tuple(job.key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
