"""The P/D hand-off between two engine cores of this process, on the production path:
``KVSender`` (prefill side) -> a connector -> ``KVReceiver`` (decode side), the same
classes the prefill and decode workers run, joined by inproc endpoints."""
from __future__ import annotations

import itertools

from triptych.connector import make_connector
from triptych.decode.kv_receiver import KVReceiver
from triptych.engine.engine_core import EngineCore
from triptych.engine.request import MMItem, Request
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.prefill.kv_sender import KVSender
from triptych.worker import wire

_names = itertools.count()


class HandOff:
    """Prefill on ``prefill``, decode on ``decode``; the KV moves as it does between pools."""

    def __init__(self, prefill: EngineCore, decode: EngineCore, timeout_s: float = 30.0) -> None:
        n = next(_names)
        self.prefill, self.decode = prefill, decode
        self.tx = make_connector("inproc", name=f"handoff-p{n}", header_type=wire.DataMsg)
        self.rx = make_connector("inproc", name=f"handoff-d{n}", header_type=wire.DataMsg)
        self.sender = KVSender(prefill, self.tx, timeout_s)  # renews the lease below
        self.receiver = KVReceiver(decode, timeout_s)

    def reserve(self, rid: str, prompt: list[int], params: SamplingParams,
                items: list[MMItem]) -> wire.KVReserved | None:
        """The decode side's reservation (None: queued until blocks free, see ``retry``).
        It sees the items' placeholders and hashes, never their pixels."""
        meta = [MMItem(it.modality, it.mm_hash, it.offset, it.length, it.grid_thw, None,
                       it.second_per_grid_t) for it in items]
        return self.receiver.reserve(wire.ReserveKV(rid, list(prompt), params), meta)

    def prefill_and_send(self, rid: str, prompt: list[int], params: SamplingParams,
                         items: list[MMItem], reserved: wire.KVReserved) -> int:
        """Prefill on the prefill core until the hand-off, sending KV after each step as a
        prefill worker does; returns the first token."""
        self.prefill.add_request(rid, prompt, params, items, hand_off_after_prefill=True)
        self.sender.add(rid, wire.KVDest("decode", self.rx.address, reserved.num_blocks,
                                         reserved.num_cached_blocks))
        first = None
        while rid in self.prefill.scheduler.requests:
            outs = self.prefill.step().outputs
            for o in outs:
                if o.request_id == rid:
                    assert o.finish_reason == "handoff", o
                    first = o.new_token_ids[-1]
            assert self.sender.after_step(outs) == []
        assert self.sender.settle() == []  # the send lanes are done with every message
        assert first is not None and rid not in self.prefill.kv.handed_off
        return first

    def receive(self) -> Request | None:
        """Copy in what arrived; the request once its final chunk is in (it is running)."""
        done = None
        while (got := self.rx.recv(1000)) is not None:
            assert len(got.tensors) == 1
            req = self.receiver.on_transfer(got.header, got.tensors[0], got.seconds)
            done = req or done
            if req is not None:
                break
        return done

    def close(self) -> None:
        self.sender.close()
        self.tx.close()
        self.rx.close()
