"""Name lookups for media URLs on their own bounded path, so one bad domain cannot starve
every other user's fetches.

``getaddrinfo`` blocks and cannot be cancelled: a domain whose DNS never answers holds its
thread until the system resolver gives up. Run in the event loop's default executor (a
handful of threads), a few such lookups stopped every other fetch. Here:

- lookups run on this resolver's own daemon threads (``--dns-threads``), never the default
  executor, and never keep the process from exiting;
- concurrent lookups of one (host, port) share one thread (coalesced);
- at most ``per_domain`` lookups per domain (the host's last two labels) run at once, and
  at most ``WAITERS_PER_LOOKUP`` times as many fetches wait on that domain's lookups: one
  beyond either is refused at once, so a black-holed domain (random subdomains included)
  holds at most ``per_domain`` threads and a few of the fetcher's slots;
- every wait has the fetch's deadline, and a waiter that gives up (timeout, client gone)
  leaves at once; the thread finishes the lookup on its own.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from triptych.api.media.limits import MediaError

Lookup = Callable[[str, int], list]  # getaddrinfo-shaped: (host, port) -> address infos
WAITERS_PER_LOOKUP = 4


def _getaddrinfo(host: str, port: int) -> list:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _domain(host: str) -> str:
    return ".".join(host.split(".")[-2:])


class Resolver:
    """Bounded, coalescing ``getaddrinfo`` for the media fetcher (one per server)."""

    def __init__(self, threads: int = 8, per_domain: int = 2,
                 lookup: Lookup = _getaddrinfo) -> None:
        self.threads, self.per_domain, self._lookup = threads, per_domain, lookup
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._running: dict[str, int] = {}  # domain -> lookups in flight
        self._waiting: dict[str, int] = {}  # domain -> callers waiting on its lookups
        self._started = 0

    def _submit(self, host: str, port: int) -> concurrent.futures.Future:
        """The lookup's future, counted as one more waiter of its domain (``_leave``)."""
        key, domain = (host, port), _domain(host)
        with self._lock:
            fut = self._pending.get(key)
            if self._waiting.get(domain, 0) >= WAITERS_PER_LOOKUP * self.per_domain or \
                    (fut is None and self._running.get(domain, 0) >= self.per_domain):
                raise MediaError("media URL host cannot be resolved (too many lookups of its "
                                 "domain pending; retry later)")
            self._waiting[domain] = self._waiting.get(domain, 0) + 1
            if fut is not None:
                return fut
            fut = concurrent.futures.Future()
            self._pending[key] = fut
            self._running[domain] = self._running.get(domain, 0) + 1
            if self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, name="triptych-dns", daemon=True).start()
        self._jobs.put((key, domain, fut))
        return fut

    def _leave(self, host: str) -> None:
        domain = _domain(host)
        with self._lock:
            self._waiting[domain] -= 1
            if not self._waiting[domain]:
                del self._waiting[domain]

    def _work(self) -> None:
        while True:
            (host, port), domain, fut = self._jobs.get()
            try:
                result: Any = self._lookup(host, port)
                error = None
            except BaseException as e:  # noqa: BLE001 - handed to the waiters
                result, error = None, e
            with self._lock:
                del self._pending[(host, port)]
                self._running[domain] -= 1
                if not self._running[domain]:
                    del self._running[domain]
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

    @staticmethod
    def _literal(host: str, port: int) -> list | None:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 0, "", (str(ip), port))]

    async def resolve(self, host: str, port: int, timeout_s: float) -> list:
        """Address infos of ``host``; MediaError if it cannot be resolved in time.
        Cancelling the caller cancels only its wait."""
        literal = self._literal(host, port)
        if literal is not None:
            return literal
        fut = self._submit(host, port)
        try:  # shield: the future may be shared with other waiters
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout_s)
        except asyncio.TimeoutError:
            raise MediaError("media URL host cannot be resolved (lookup timed out)") from None
        except (OSError, UnicodeError):
            raise MediaError("media URL host cannot be resolved") from None
        finally:
            self._leave(host)

    def resolve_blocking(self, host: str, port: int, timeout_s: float) -> list:
        """``resolve`` for a worker thread (the processor re-fetching a URL)."""
        literal = self._literal(host, port)
        if literal is not None:
            return literal
        fut = self._submit(host, port)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise MediaError("media URL host cannot be resolved (lookup timed out)") from None
        except (OSError, UnicodeError):
            raise MediaError("media URL host cannot be resolved") from None
        finally:
            self._leave(host)


__all__ = ["Resolver"]
