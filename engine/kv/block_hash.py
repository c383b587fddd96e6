"""Prefix-cache block hashes: a chain over full blocks of token ids and images.

    hash(block i) = H(hash(block i-1), token ids of block i, mm hashes overlapping block i)

Image placeholder tokens are the same for every image, so without the mm hashes two
different images with identical text would share KV (vLLM #20261): every item whose
placeholder span overlaps a block's token range goes into that block's hash.

A request's cache salt (its tenant and ``cache_salt``, see api/tenancy.py) is the first
block's parent, so the whole chain differs between tenants: a prefix-cache hit, and the
``cached_tokens`` it reports, would otherwise tell one tenant what another one sent.
"""
from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from triptych.engine.request import Request

_enc = msgspec.msgpack.Encoder()


def hash_block(parent: bytes | None, token_ids: list[int], mm_hashes: list[str]) -> bytes:
    return hashlib.sha256(_enc.encode((parent or b"", token_ids, mm_hashes))).digest()


def chain_hashes(tokens: list[int], items: list[Any], block_size: int,
                 hashes: list[bytes] | None = None, salt: str | None = None) -> list[bytes]:
    """Hashes of every full block of ``tokens``, extending the chain ``hashes`` (in place
    when given). ``items``: anything with ``offset``, ``end`` and ``mm_hash``; ``salt``:
    the request's cache scope (None: the shared, unsalted chain)."""
    hashes = [] if hashes is None else hashes
    root = salt.encode("utf-8", "surrogatepass") if salt else None
    for i in range(len(hashes), len(tokens) // block_size):
        s, e = i * block_size, (i + 1) * block_size
        mm = [it.mm_hash for it in items if it.offset < e and it.end > s]
        hashes.append(hash_block(hashes[-1] if hashes else root, tokens[s:e], mm))
    return hashes


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Append hashes for the request's full blocks that have none yet.

    Only blocks of tokens whose ids are known are hashed (prompt + sampled outputs).
    """
    if request.num_tokens // block_size <= len(request.block_hashes):
        return  # (before the token list is built: a copy of every id per call)
    # NOTE: the salt rides on the sampling parameters: they reach every pool unchanged
    # (AddRequest, ReserveKV, migration), so no pool's wire needs a field of its own.
    chain_hashes(request.all_token_ids, request.mm_items, block_size, request.block_hashes,
                 request.sampling_params.cache_salt)
