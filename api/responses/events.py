"""A streamed response's events, in OpenAI's order, each with its ``sequence_number``:

    response.created, response.in_progress
    per message:  output_item.added, content_part.added, output_text.delta ...,
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta ...,
                  function_call_arguments.done, output_item.done
    response.completed (response.incomplete when max_output_tokens cut it)

Every opened item is closed, every ``done`` follows at least one ``delta`` of its kind (an
empty one if the model wrote nothing), so a client pairing them never waits forever.
"""
from __future__ import annotations

import json
from typing import Any

from triptych.api.responses.format import new_id


class EventStream:
    def __init__(self) -> None:
        self.seq = 0
        self.index = -1  # output_index of the open item
        self.message: dict[str, Any] | None = None  # the open message item
        self.text = ""
        self.logprobs: list[Any] = []
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.ids: dict[str, str] = {}  # item ids the final response object reuses
        self.calls = 0

    def event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj)}\n\n"

    def text_delta(self, delta: str, logprobs: list[Any]) -> list[str]:
        out = self.close_call()
        if self.message is None:
            self.index += 1
            self.ids["msg"] = mid = new_id("msg")
            self.message = {"type": "message", "id": mid, "status": "in_progress",
                            "role": "assistant", "content": []}
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=self.message))
            out.append(self.event("response.content_part.added", item_id=mid,
                                  output_index=self.index, content_index=0,
                                  part={"type": "output_text", "text": "",
                                        "annotations": []}))
        self.text += delta
        self.logprobs += logprobs
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self.index, content_index=0, delta=delta,
                              logprobs=logprobs))
        return out

    def close_message(self) -> list[str]:
        if self.message is None:
            return []
        mid, part = self.message["id"], {"type": "output_text", "text": self.text,
                                         "annotations": [], "logprobs": self.logprobs}
        item = {**self.message, "status": "completed", "content": [part]}
        self.message = None
        return [self.event("response.output_text.done", item_id=mid, output_index=self.index,
                           content_index=0, text=self.text, logprobs=self.logprobs),
                self.event("response.content_part.done", item_id=mid,
                           output_index=self.index, content_index=0, part=part),
                self.event("response.output_item.done", output_index=self.index, item=item)]

    def call_delta(self, tc: dict[str, Any]) -> list[str]:
        """One streamed tool-call delta (api/tools/reader.py's shape)."""
        out: list[str] = []
        args = tc["function"].get("arguments") or ""
        if "id" in tc:  # a new call
            out += self.close_message() + self.close_call()
            self.index += 1
            n = self.calls
            self.calls += 1
            self.ids[f"fc{n}"] = fid = new_id("fc")
            self.ids[f"call{n}"] = tc["id"]
            self.call = {"type": "function_call", "id": fid, "call_id": tc["id"],
                         "name": tc["function"]["name"], "arguments": "",
                         "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=dict(self.call)))
        if self.call is not None and (args or "id" in tc):
            self.call["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=self.call["id"], output_index=self.index,
                                  delta=args))
        return out

    def close_call(self) -> list[str]:
        if self.call is None:
            return []
        item = {**self.call, "status": "completed"}
        self.call = None
        return [self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=self.index, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=self.index, item=item)]

    def close(self) -> list[str]:
        """Close what is open; a response that wrote nothing still has its message."""
        out = self.close_message() + self.close_call()
        if self.index < 0:
            out += self.text_delta("", []) + self.close_message()
        return out


__all__ = ["EventStream"]
