"""The process loop every pool worker runs (colocated, encode, prefill, decode).

    supervisor (P0) --spawns--> python -m triptych.<pool>.worker   (WorkerSpec as JSON on stdin)
    worker: build the pool's handler (loads the model), connect a DEALER to the router,
            send Hello, then loop:
              poll the router (and the handler's data sockets) -> handler.handle(msg)
              handler.step() when it has work -> replies to the router
              WorkerStats every STATS_INTERVAL_S
            a thread beside the loop: Heartbeat every HEARTBEAT_INTERVAL_S on a socket of
            its own (worker/heartbeat.py), so a long step never looks like a dead worker

What keeps one bad message or one bad request from hurting the rest:
- every message is decoded against a fixed union; garbage is logged and dropped;
- the handler turns a refused request into a RequestError for that request only;
- the engine core isolates a failing step to the request that causes it;
- but a broken runner (a tensor-parallel rank died: ``RunnerBroken``), even when its
  signal lands while a message is handled, ends the process: the router migrates its
  requests (it is never the request's fault, so never a 400).
What keeps the process from outliving the server: the kernel sends SIGUSR1 when P0 dies
(prctl PDEATHSIG, Linux), the loop also checks its parent every iteration; both, SIGTERM
(the supervisor's stop) and a Shutdown message end the loop through the same clean path.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from triptych.engine.runner.model_runner import RunnerBroken
from triptych.worker import wire
from triptych.worker.allocator import StepTrim
from triptych.worker.heartbeat import HeartbeatThread

logger = logging.getLogger("triptych.worker")
STATS_INTERVAL_S = 0.25
IDLE_POLL_MS = 100
SEND_TIMEOUT_MS = 1000
ROUTER_GONE_S = 30.0  # a router that takes nothing for this long is gone: stop
HELLO_EVERY_S = 5.0  # a worker on another host announces itself again (a restarted router
# learns it without the worker restarting)


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What the supervisor tells a worker process (JSON on its stdin)."""

    worker_id: str  # "<pool>-<index>#<incarnation>": its identity on the router socket
    pool: str  # colocated | encode | prefill | decode
    router_address: str  # the router's ROUTER socket (ipc:// locally, tcp:// across hosts)
    config: dict[str, Any]  # EngineConfig keyword arguments
    eos_token_id: int | None = None  # from the tokenizer P0 loaded
    parent_pid: int = 0  # exit when this process goes away (0: not supervised locally)
    num_threads: int = 1  # torch intra-op threads of this worker
    key_name: str | None = None  # its CURVE key's name (worker_keys); default: pool-index
    remote: bool = False  # on another host than the router (`triptych worker`)
    shm_ring: str | None = None  # P0's shared-memory processor cache (mm_processor_cache_type=shm)


class Handler:
    """The pool-specific part of a worker. Every method returns messages for the router."""

    def hello(self, spec: WorkerSpec) -> wire.Hello:
        raise NotImplementedError

    def handle(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        """One control message from the router."""
        raise NotImplementedError

    def has_work(self) -> bool:
        """Whether ``step`` has something to compute (else the loop waits for input)."""
        return False

    def step(self) -> list[msgspec.Struct]:
        return []

    def after_step(self) -> list[msgspec.Struct]:
        """Runs once ``step``'s replies are sent (e.g. KV that must leave after them)."""
        return []

    def data_socket(self) -> zmq.Socket | None:
        """The connector socket to poll beside the router's (pool workers)."""
        return None

    def on_data(self) -> list[msgspec.Struct]:
        """The data socket is readable: take what arrived."""
        return []

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        """Every loop iteration: leases, timeouts, queued work."""
        return []

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release sockets, segments, files (the process is about to exit)."""


class _Named(msgspec.Struct):
    request_id: str


_named = msgspec.msgpack.Decoder(_Named)


class _Stop(Exception):
    """SIGTERM, the parent's death, or a Shutdown message."""


class _Orphaned(_Stop):
    """The process that started us is gone."""


def _die_with_parent() -> None:
    """Ask the kernel for SIGUSR1 when the process that started us exits (Linux). Its own
    signal, not SIGTERM: when it arrives getppid() may still name the dying parent, and
    only an orphan should remove the parent's socket dir."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGUSR1)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the getppid() check below still holds
        pass


_stopping = False  # a stop signal was taken: later ones (the kernel may send the death
# signal again, SIGTERM may follow) must not raise inside the clean-up path


def _on_sigterm(signum: int, frame: Any) -> None:
    global _stopping
    if not _stopping:
        _stopping = True
        raise _Stop("SIGTERM")


def _on_parent_death(signum: int, frame: Any) -> None:
    global _stopping
    if not _stopping:
        _stopping = True
        raise _Orphaned("the API server process is gone")


def run_worker(spec: WorkerSpec, make_handler: Callable[[WorkerSpec], Handler]) -> None:
    """Process entry point of every pool worker."""
    global _stopping
    orphaned = False
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[{spec.worker_id}]: "
                               "%(message)s")
    if spec.parent_pid:
        # NOTE: Ctrl-C reaches the whole process group; P0 owns shutdown and stops us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, _on_parent_death)
        _die_with_parent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    from triptych.engine.device.platform import applies_host_policies
    from triptych.worker.threads import apply_thread_policy

    # CPU workers take the thread and allocator policies; a GPU worker keeps torch's own
    if applies_host_policies(str(spec.config.get("device", "auto"))):
        apply_thread_policy(max(1, spec.num_threads))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    handler: Handler | None = None
    secure = (lambda s: _secure(s, spec)) if spec.router_address.startswith("tcp://") else None
    heartbeat = HeartbeatThread(ctx, spec.worker_id, spec.router_address, secure)
    try:
        _check_parent(spec)
        heartbeat.start()  # NOTE: before the model loads: a frozen loader is caught too
        handler = make_handler(spec)
        sock.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        if spec.router_address.startswith("tcp://"):  # another host: CURVE, or nothing
            _secure(sock, spec)
        sock.connect(spec.router_address)
        _send(sock, _hello(handler, spec), spec)
        _loop(spec, handler, sock, heartbeat)
    except _Stop as e:
        _stopping = True
        logger.info("worker stops (%s)", e)
        orphaned = isinstance(e, _Orphaned)  # getppid() may still name the dying parent
    finally:
        _stopping = True  # from here on a signal changes nothing
        if orphaned or (spec.parent_pid and os.getppid() != spec.parent_pid):
            _remove_run_dir(spec)  # whatever ended the loop: an orphan cleans up for P0
        heartbeat.stop()
        if handler is not None:
            handler.close()
        sock.close(0)
        ctx.term()


def _secure(sock: zmq.Socket, spec: WorkerSpec) -> None:
    from triptych.connector.auth import load_keys, secure_client

    keys_dir = spec.config.get("worker_keys")
    if not keys_dir:
        raise ValueError("a router on another host is reached over CURVE only: give "
                         "--worker-keys (made by `triptych keys`)")
    keys = load_keys(keys_dir, spec.key_name or spec.worker_id.partition("#")[0])
    if "router" not in keys.peers:
        raise ValueError(f"no public key named router in {keys_dir}/public")
    secure_client(sock, keys, keys.peers["router"])


def _remove_run_dir(spec: WorkerSpec) -> None:
    """P0 was killed and cannot remove its socket dir: do it (only a dir of the dead
    parent's, named by the supervisor: <tmp>/triptych-<parent pid>-*)."""
    path = os.path.dirname(spec.router_address.removeprefix("ipc://"))
    name = os.path.basename(path)
    if spec.router_address.startswith("ipc://") and \
            name.startswith(f"triptych-{spec.parent_pid}-"):
        shutil.rmtree(path, ignore_errors=True)


def _check_parent(spec: WorkerSpec) -> None:
    global _stopping
    if spec.parent_pid and os.getppid() != spec.parent_pid:
        _stopping = True
        raise _Orphaned("the API server process is gone")


def _send(sock: zmq.Socket, msg: msgspec.Struct, spec: WorkerSpec) -> None:
    """Send to the router; while it cannot take the message, check that it still exists."""
    data = wire.encode(msg)
    deadline = time.monotonic() + ROUTER_GONE_S
    while True:
        try:
            sock.send_multipart(data)
            return
        except zmq.Again:
            _check_parent(spec)
            if time.monotonic() > deadline:
                raise _Stop("the router took no message for 30 s") from None


def _loop(spec: WorkerSpec, handler: Handler, sock: zmq.Socket,
          heartbeat: HeartbeatThread) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    data = handler.data_socket()
    if data is not None:
        poller.register(data, zmq.POLLIN)
    last_stats = last_hello = time.monotonic()
    trim = StepTrim()  # the allocator keeps what recent steps need (worker/allocator.py)
    while True:
        _check_parent(spec)
        timeout = 0 if handler.has_work() else IDLE_POLL_MS
        for _ in range(1024):  # drain what arrived (bounded: a flood cannot starve steps)
            ready = dict(poller.poll(timeout))
            if not ready:
                break
            timeout = 0
            if sock in ready:  # control first: a request is known before its data lands
                for reply in _receive(handler, sock.recv_multipart(copy=True)):
                    _send(sock, reply, spec)
            if data is not None and data in ready:
                for reply in handler.on_data():
                    _send(sock, reply, spec)
        for reply in handler.housekeeping(time.monotonic()):
            _send(sock, reply, spec)
        if handler.has_work():
            heartbeat.step_begins()
            try:
                if spec.worker_id in _TEST_HANG_STEP:
                    _hang_forever()
                replies = handler.step()
            finally:
                heartbeat.step_ends()
            trim.after_step()
            if _ends_a_request(replies):
                # NOTE: the stats go first (one socket: P0 reads them in order), so once a
                # client has its last token /metrics counts the step that made it, as
                # vLLM's do (its frontend records each step's stats with its outputs)
                last_stats = time.monotonic()
                _send(sock, wire.WorkerStats(handler.stats()), spec)
            for reply in replies:
                _send(sock, reply, spec)
            for reply in handler.after_step():
                _send(sock, reply, spec)
        now = time.monotonic()
        if spec.remote and now - last_hello >= HELLO_EVERY_S:
            last_hello = now
            _send(sock, _hello(handler, spec), spec)
        if now - last_stats >= STATS_INTERVAL_S:
            last_stats = now
            _send(sock, wire.WorkerStats(handler.stats()), spec)


def _ends_a_request(replies: list[msgspec.Struct]) -> bool:
    return any(isinstance(r, wire.StepOutputs) and any(o.finish_reason for o in r.outputs)
               for r in replies)


# TEST HOOK (tests/test_step_watchdog.py): the workers named here (comma-separated worker
# ids such as "colocated-0#0") never return from their first step, as a hung kernel would,
# while their heartbeat goes on. Nothing else reads it; unset, it costs one set lookup.
_TEST_HANG_STEP = frozenset(filter(None, os.environ.get("TRIPTYCH_TEST_HANG_STEP", "").split(",")))


def _hang_forever() -> None:
    logger.warning("TRIPTYCH_TEST_HANG_STEP: this step never returns (a test hook)")
    while True:
        time.sleep(1.0)


_fingerprints: dict[str, str] = {}


def _hello(handler: Handler, spec: WorkerSpec) -> wire.Hello:
    """The handler's Hello; a worker on another host adds its model's fingerprint (the
    router refuses one that serves another checkpoint)."""
    hello = handler.hello(spec)
    if not spec.remote:
        return hello
    model = str(spec.config.get("model", ""))
    if model not in _fingerprints:
        from triptych.worker.fingerprint import model_fingerprint

        _fingerprints[model] = model_fingerprint(model)
    return msgspec.structs.replace(hello, model_fingerprint=_fingerprints[model])


def _receive(handler: Handler, frames: list[bytes]) -> list[msgspec.Struct]:
    """One message from the router. Nothing a message holds ends the loop but Shutdown."""
    try:
        msg = wire.decode_to_worker(frames)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as e:
        # NOTE: answer whatever names a request, or the router would wait for it forever.
        try:
            rid = _named.decode(frames[0]).request_id
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            logger.warning("dropped a malformed message (%d frames)", len(frames))
            return []
        return [wire.RequestError(rid, f"malformed request: {e}")]
    if isinstance(msg, wire.Shutdown):
        raise _Stop("Shutdown message")
    try:
        return handler.handle(msg, frames)
    except RunnerBroken:  # a rank died (its signal may land here): the worker is broken
        raise
    except Exception:  # our bug, not the message's: log it, keep serving
        logger.exception("handling a %s message failed", type(msg).__name__)
        rid = getattr(msg, "request_id", None)
        return [wire.RequestError(rid, "internal error")] if rid else []


def main(make_handler: Callable[[WorkerSpec], Handler]) -> None:
    """``python -m triptych.<pool>.worker`` with the WorkerSpec as JSON on stdin."""
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    code = 0
    try:
        run_worker(spec, make_handler)
    except BaseException:
        logger.exception("worker failed")
        code = 1
    finally:
        # NOTE: skip interpreter finalization: joining torch's thread pools and library
        # destructors held a dying worker for seconds; our sockets are already closed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
