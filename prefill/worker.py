"""The prefill worker: a request's prompt KV and first token, then the KV to a decode worker.

    AddRequest(kv_dest)  -> [wait for embeddings from the encode pool] -> prefill (chunked,
                            prefix-cached) -> first token to the router (StepOutputs,
                            finish_reason "handoff") -> the KV blocks to the decode worker
                            (KVSender: full blocks as chunks finish, the rest at hand-off,
                            on send lanes: the loop never waits for a decode peer)

Without an encode pool the worker runs the vision tower itself on the pixels it receives.
The rest (pixels, inbox, data socket, hello) is ``worker/model_worker.py``'s.
``python -m triptych.prefill.worker`` (started by the supervisor).
"""
from __future__ import annotations

import msgspec
from triptych.engine.request import MMItem
from triptych.prefill.kv_sender import KVSender
from triptych.worker import wire
from triptych.worker.loop import WorkerSpec, main
from triptych.worker.model_worker import ModelWorker


class PrefillWorker(ModelWorker):
    """A prefill-pool worker: requests end after their first token; their KV moves on."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, data_plane=True)
        self.sender = KVSender(self.core, self.connector, self.config.kv_transfer_timeout)

    def _add(self, msg: wire.AddRequest, items: list[MMItem]) -> list[msgspec.Struct]:
        if msg.kv_dest is None:
            raise ValueError("a prefill worker needs a KV destination")
        return super()._add(msg, items)

    def admit(self, msg: wire.AddRequest, items: list[MMItem]) -> None:
        self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items,
                              hand_off_after_prefill=True, output_token_ids=msg.output_token_ids)
        assert msg.kv_dest is not None
        self.sender.add(msg.request_id, msg.kv_dest)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.sender.cancel(request_id)

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        failed = self.sender.keepalive(now)  # the decode side's leases, renewed while we hold them
        return super().housekeeping(now) + [
            wire.RequestError(rid, "KV transfer to the decode worker failed", retryable=True)
            for rid in failed]

    def after_step(self) -> list[msgspec.Struct]:
        # NOTE: the first token reached the router (step's reply) before its KV leaves, so
        # the router knows the request moved before the decode worker's tokens arrive.
        failed = self.sender.after_step(self.last_outputs)
        return [wire.RequestError(rid, "KV transfer to the decode worker failed",
                                  retryable=True) for rid in failed]

    def close(self) -> None:
        self.sender.close()  # its lanes stop before the connector they send on closes
        super().close()

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["kv_transfer_bytes_total"] = self.sender.bytes_sent
        s["kv_transfers_total"] = self.sender.transfers
        s["kv_lease_renewals_total"] = self.sender.keepalives
        s["kv_transfer_rank_to_rank_total"] = self.sender.sliced
        s["kv_sends_held_back_total"] = self.sender.held_back
        s["requests_waiting_for_embeddings"] = len(self.inbox)
        s["tracked_kv_outgoing"] = self.sender.num_outgoing
        return s


if __name__ == "__main__":
    main(PrefillWorker)
