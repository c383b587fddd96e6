"""Dispatch: start one attempt of a child on the layout's pools.

    colocated / PD       AddRequest(pixels) -> one worker prefills, encodes and decodes
    E+PD                 AddRequest(no pixels) -> decode worker; EncodeRequest -> encode
                         worker, which sends the embeddings to that decode worker
    P+D / E+P+D          ReserveKV -> decode worker (KVReserved); AddRequest(kv_dest) ->
                         prefill worker (+ EncodeRequest -> encode worker)

A path that cannot go on raises ``Retry`` (a worker is unreachable, no reservation came)
or ``EngineDeadError`` (a pool has no live worker); the caller (router/migration.py)
decides what follows. An attempt ended while its path awaited something (its worker died,
the client went away) is left where it is: ending it gave back what it held.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from triptych.router.errors import Retry
from triptych.router.handle import WorkerHandle
from triptych.router.layout import Layout
from triptych.router.pixel_planner import PixelPlanner
from triptych.router.registry import WorkerRegistry
from triptych.router.requests import Attempt, ClientRequest
from triptych.router.sockets import RouterSockets
from triptych.worker import wire

AddRequestFactory = Callable[..., wire.AddRequest]


def request_factory(a: Attempt, streamed: list[int],
                    kv_dest: wire.KVDest | None = None) -> AddRequestFactory:
    """How attempt ``a``'s AddRequest is made once its items are planned:
    ``build(items, evicted=(), seq=0, encoding=())`` (the pixel planner passes the first
    three; the encode path names the hashes an encode worker is asked to send). With
    ``kv_dest`` the receiving worker is a prefill worker that hands the KV off there."""
    prompt = a.child.parent.prompt

    def build(items: list[wire.WireMMItem], evicted: list[str] = (), seq: int = 0,
              encoding: list[str] = ()) -> wire.AddRequest:
        return wire.AddRequest(a.core_id, prompt.prompt_token_ids, a.child.params, items,
                               streamed, kv_dest, list(encoding), list(evicted), seq)

    return build


def wire_item(it: Any) -> wire.WireMMItem:
    """An item without pixels (its embedding is cached or on its way)."""
    return wire.WireMMItem(it.modality, it.mm_hash, it.offset, it.length, list(it.grid_thw),
                           None, it.second_per_grid_t)


def _sources(request: ClientRequest, items: list[Any]) -> list[Any]:
    """Each item's MediaSource (to produce skipped pixels again), or None."""
    by_hash = {it.mm_hash: src for it, src in zip(request.prompt.mm_items,
                                                   request.prompt.mm_sources)}
    return [by_hash.get(it.mm_hash) for it in items]


class Dispatcher:
    def __init__(self, layout: Layout, kv_transfer_timeout: float, registry: WorkerRegistry,
                 sockets: RouterSockets, pixels: PixelPlanner,
                 streamed: Callable[[str], list[int]]) -> None:
        """``streamed(child_id)``: the tokens a child already streamed (a resumed attempt
        recomputes them and never emits them again)."""
        self.layout = layout
        self.kv_transfer_timeout = kv_transfer_timeout
        self.registry = registry
        self.sockets = sockets
        self.pixels = pixels
        self.streamed = streamed

    async def run(self, a: Attempt) -> None:
        """Start attempt ``a``: every message of its path sent."""
        if self.layout.has_prefill_pool:
            await self._run_disaggregated(a)
        else:
            await self._run_together(a)

    async def _run_together(self, a: Attempt) -> None:
        """colocated / PD / E+PD: one worker prefills and decodes."""
        c = a.child
        w = self.registry.choose(self.layout.main_pool, c.parent.hashes)
        a.worker = w
        a.charge(w, len(c.parent.prompt.prompt_token_ids) + (c.params.max_tokens or 0))
        await self._send_items(a, w, request_factory(a, self.streamed(c.child_id)))

    async def _run_disaggregated(self, a: Attempt) -> None:
        """P+D / E+P+D: reserve KV on a decode worker, then prefill on a prefill worker."""
        c = a.child
        prompt = c.parent.prompt
        streamed = self.streamed(c.child_id)
        d = self.registry.choose("decode", c.parent.hashes)
        a.decode = d
        a.charge(d, len(prompt.prompt_token_ids) + (c.params.max_tokens or 0))
        a.reserved = reserved = asyncio.get_running_loop().create_future()
        meta = [wire_item(it) for it in prompt.mm_items]
        await self._send(d, wire.ReserveKV(a.core_id, prompt.prompt_token_ids, c.params, meta,
                                           streamed))
        # The decode worker queues the reservation while it has no room: bounded. NOTE:
        # asyncio.wait, not wait_for: ending the attempt cancels the future, which must not
        # look like this task being cancelled.
        await asyncio.wait({reserved}, timeout=self.kv_transfer_timeout + 5)
        if a.ended:
            return
        if not reserved.done():
            raise Retry(f"{d.name} reserved no KV blocks in time")
        got: wire.KVReserved = reserved.result()
        p = self.registry.choose("prefill", c.parent.hashes)
        a.worker = p
        a.charge(p, len(prompt.prompt_token_ids))
        dest = wire.KVDest(d.name, d.info["data_address"], got.num_blocks,
                           got.num_cached_blocks, list(d.info.get("rank_addresses", [])))
        await self._send_items(a, p, request_factory(a, streamed, dest))

    async def _send_items(self, a: Attempt, target: WorkerHandle,
                          build: AddRequestFactory) -> None:
        """Send ``target`` its AddRequest: with the pixels (through the processor cache)
        when it runs the vision tower itself; else without them, plus an EncodeRequest to
        an encode worker for the embeddings ``target`` lacks."""
        request = a.child.parent
        mm = request.prompt.mm_items
        if not self.layout.has_encode_pool:
            await self._send_pixels(a, target, mm, build)
            return
        # NOTE: recorded as held now, before any await: a concurrent request with the same
        # image then waits for this encode on the target instead of asking for another one.
        encoding = target.missing_embeddings([it.mm_hash for it in mm])
        await self._send(target, build([wire_item(it) for it in mm], encoding=encoding))
        if not a.ended:
            await self.encode(a, target, encoding)

    async def encode(self, a: Attempt, target: WorkerHandle, hashes: list[str]) -> None:
        """Ask an encode worker to send ``target`` the embeddings of ``hashes``."""
        if not hashes:
            return
        request = a.child.parent
        todo = [it for it in request.prompt.mm_items if it.mm_hash in hashes]
        todo = list({it.mm_hash: it for it in todo}.values())
        e = self.registry.choose("encode", request.hashes)
        a.encode = e
        a.charge(e, sum(it.grid_thw[0] * it.grid_thw[1] * it.grid_thw[2]
                        for it in todo))  # patches
        address = target.info["data_address"]

        def build(items: list[wire.WireMMItem], evicted: list[str], seq: int
                  ) -> wire.EncodeRequest:
            return wire.EncodeRequest(a.core_id, items, address, evicted, seq)

        await self._send_pixels(a, e, todo, build)

    async def _send_pixels(self, a: Attempt, w: WorkerHandle, items: list[Any],
                           build: Callable[..., msgspec.Struct]) -> None:
        """Send ``w`` the message ``build`` makes, with the items' pixels planned by the
        processor cache (router/pixel_planner.py)."""
        ok = await self.pixels.send(w, items, _sources(a.child.parent, items), build,
                                    self.sockets.send_frames, a.pins)
        if a.ended:  # NOTE: ended while the planner awaited: give back what it pinned since
            self.pixels.unpin(a.pins)
            a.pins = []
        elif not ok:
            raise Retry(f"{w.name} is not reachable")

    async def _send(self, w: WorkerHandle, msg: msgspec.Struct) -> None:
        if not await self.sockets.send(w, msg):
            raise Retry(f"{w.name} is not reachable")
