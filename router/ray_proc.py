"""RayProc: a pool worker's Ray actor seen as a process by the supervisor.

The supervisor watches local processes through ``poll / wait / kill / send_signal / pid``;
a Ray worker (router/ray_backend.py) gives it the same surface over its actor: the actor's
``run()`` call ending (or failing: actor death, node loss, Ray's own notice) is the exit,
any signal is a request to stop (a Shutdown message on its socket), kill is ``ray.kill``.
"""
from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from typing import Any

from triptych.router.handle import WorkerHandle

logger = logging.getLogger("triptych.ray")


class RayProc:
    """A worker's actor seen as a process by the supervisor (poll / wait / kill /
    send_signal / pid), so Ray's deaths take the path of local exits."""

    def __init__(self, actor: Any, run_ref: Any, node_ref: Any, handle: WorkerHandle,
                 on_stop: Callable[[], None]) -> None:
        self.actor, self.run_ref, self._node_ref = actor, run_ref, node_ref
        self._handle, self._on_stop = handle, on_stop
        self.returncode: int | None = None
        self._node: dict[str, str] | None = None

    @property
    def pid(self) -> int:
        return int(self._handle.info.get("pid") or (self._node or {}).get("pid") or 0)

    def settled_pid(self, timeout: float = 5.0) -> int:
        """Once it was killed: its process's pid if the actor ever ran (its node() call
        answered), else 0 (no process ran our code, so none left a key dir). Bounded."""
        import ray

        if self._node is None and ray.wait([self._node_ref], timeout=timeout)[0]:
            try:
                self._node = ray.get(self._node_ref)
            except ray.exceptions.RayError:
                self._node = {}
        return self.pid

    @property
    def node(self) -> dict[str, str] | None:
        """{"node_id", "ip"} once Ray has placed the actor (None before)."""
        import ray

        if self._node is None and ray.wait([self._node_ref], timeout=0)[0]:
            try:
                self._node = ray.get(self._node_ref)
            except ray.exceptions.RayError:
                self._node = {}
        return {k: v for k, v in self._node.items() if k != "pid"} if self._node else None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self.run_ref], timeout=0)[0]:
            try:
                self.returncode = int(ray.get(self.run_ref))
            except ray.exceptions.RayError as e:
                logger.error("%s: Ray reports its actor gone: %s", self._handle.identity,
                             str(e).splitlines()[0][:200])
                self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        if self.returncode is None:
            try:
                ray.get(self.run_ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise subprocess.TimeoutExpired("ray actor", timeout or 0) from None
            except ray.exceptions.RayError:
                pass
            self.poll()
        return self.returncode if self.returncode is not None else -9

    def send_signal(self, sig: int) -> None:
        """Any signal is a request to stop: a Shutdown message on its socket."""
        self._on_stop()

    def terminate(self) -> None:
        self._on_stop()

    def kill(self) -> None:
        import ray

        if self.returncode is None:
            self.returncode = -9
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - gone with its node
            logger.debug("ray.kill(%s): %s", self._handle.identity, e)
