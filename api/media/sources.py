"""Where media bytes come from: data: URLs, local files under the allowed directory, and
http(s) URLs behind an SSRF guard. Threats designed against (../shared/THREATS.md):

- SSRF: resolve the host, refuse private/loopback/link-local/reserved addresses unless the
  operator allows them, connect to the very address that was checked (DNS cannot rebind),
  re-check every redirect hop; URLs are parsed once, here.
- Local reads outside the allowed directory: the path is walked from the directory one
  component at a time with ``openat(O_NOFOLLOW)``, so no symbolic link is ever followed and
  swapping a directory for a link between check and open cannot redirect the read (the file
  read is the one opened, from its descriptor).
- Slow or huge downloads: one deadline for the whole fetch (connect, redirects, body) and a
  byte cap; errors name the problem, never internals.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import ipaddress
import os
import socket
import stat
import time
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from triptych.api.media.limits import MediaError, MediaLimits

_OUTSIDE = ("media path is outside the allowed local media directory (paths are taken as "
            "written; symbolic links are not followed)")


def data_url(url: str, max_bytes: int) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise MediaError("data URLs must be base64-encoded (data:<mime>;base64,...)")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaError(f"media is larger than the {max_bytes} byte limit (--max-media-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 in data URL") from None


# -- local files --------------------------------------------------------------------------
def _relative_parts(path: str, root: str) -> list[str]:
    """``path``'s components below ``root`` (as written, or as realpath'd), else refuse."""
    norm = os.path.normpath(path)
    for base in dict.fromkeys((os.path.realpath(root), os.path.normpath(os.path.abspath(root)))):
        prefix = base.rstrip("/") + "/"
        if norm.startswith(prefix):
            parts = norm[len(prefix):].split("/")
            if parts and all(p not in ("", ".", "..") for p in parts):
                return parts
    raise MediaError(_OUTSIDE)


def local_file(path: str, limits: MediaLimits, max_bytes: int) -> bytes:
    root = limits.allowed_local_media_path
    if not root:
        raise MediaError("local media paths are disabled (start with --allowed-local-media-path)")
    parts = _relative_parts(path, root)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    dir_fd = os.open(os.path.realpath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts[:-1]:
            fd = os.open(name, flags | os.O_DIRECTORY, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = fd
        # O_NONBLOCK: a FIFO planted under the root must not hang the open.
        fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # a link on the way
            raise MediaError(_OUTSIDE) from None
        if e.errno == errno.ENOENT:
            raise MediaError("media file not found") from None
        raise MediaError("media file cannot be opened") from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)  # what was opened, not what the path names now
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        os.close(fd)
        raise MediaError("media path is not a regular file" if not stat.S_ISREG(st.st_mode)
                         else f"media is larger than the {max_bytes} byte limit "
                              "(--max-media-bytes)")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew after the fstat
        raise MediaError(f"media is larger than the {max_bytes} byte limit (--max-media-bytes)")
    return data


# -- http(s) --------------------------------------------------------------------------------
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: IPv4 in the last 32 bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: a site's own, never public
_V4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d (also :: and ::1)


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a media fetch may connect to ``ip``. An IPv6 address that carries an IPv4
    one (``::ffff:a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d``, 6to4 ``2002:AABB:CCDD::``,
    ``::a.b.c.d``) is judged by the IPv4 address it reaches: ``ipaddress`` calls
    ``64:ff9b::a00:1`` global though a NAT64 gateway takes it to 10.0.0.1. Teredo
    (2001::/32) tunnels to any IPv4 client and local-use NAT64 prefixes stay inside a
    site: both refused."""
    if ip.version == 6:
        if ip.teredo is not None or ip in _NAT64_LOCAL:
            return False
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and (ip in _NAT64 or ip in _V4_COMPATIBLE):
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            return is_public(inner)
    return ip.is_global and not ip.is_multicast


def _vetted_address(infos: list, check: bool) -> str:
    """One address of a host's ``infos``; with ``check``, every address must be public."""
    addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    for ip in addrs:
        if check and not is_public(ip):
            raise MediaError("media URL resolves to a private or reserved address")
    if not addrs:
        raise MediaError("media URL host cannot be resolved")
    return str(addrs[0])


Hop = tuple[str, dict[str, str], dict[str, Any]]  # pinned URL, headers, extensions


def plan_hop(url: str, limits: MediaLimits) -> Hop:
    """Check one hop's URL; return (URL pinned to the vetted address, headers, extensions).

    NOTE: the URL is parsed once, here, and the request goes to the address checked here:
    httpx never re-parses the client's host (parser mismatches) or re-resolves it (rebinding).
    """
    parts, host, port, check = _hop_target(url, limits)
    if limits.resolver is not None:
        infos = limits.resolver.resolve_blocking(host, port, limits.fetch_timeout_s)
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise MediaError("media URL host cannot be resolved") from None
    return _pinned(parts, host, port, _vetted_address(infos, check))


async def aplan_hop(url: str, limits: MediaLimits) -> Hop:
    """``plan_hop`` on an event loop: the lookup on the resolver's own bounded threads."""
    if limits.resolver is None:
        return await asyncio.to_thread(plan_hop, url, limits)
    parts, host, port, check = _hop_target(url, limits)
    infos = await limits.resolver.resolve(host, port, limits.fetch_timeout_s)
    return _pinned(parts, host, port, _vetted_address(infos, check))


def _hop_target(url: str, limits: MediaLimits) -> tuple[Any, str, int, bool]:
    """-> (parsed URL, host, port, whether its addresses must be public)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise MediaError("malformed media URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError("only http(s) media URLs can be fetched")
    if not url.isascii():
        raise MediaError("media URLs must be ASCII (percent-encode paths, punycode hosts)")
    if "@" in parts.netloc or any(c in url for c in "\\\r\n\t "):
        raise MediaError("malformed media URL")
    host = parts.hostname.rstrip(".")  # urlsplit lowercases it
    port = port or (443 if parts.scheme == "https" else 80)
    allowed = limits.allowed_domains
    listed = allowed is not None and host in {d.lower().rstrip(".") for d in allowed}
    if allowed is not None and not listed:
        raise MediaError("media URL host is not in the allowed domains (--allowed-media-domains)")
    return parts, host, port, not (limits.allow_private_addresses or listed)


def _pinned(parts: Any, host: str, port: int, ip: str) -> Hop:
    netloc = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    default_port = port == (443 if parts.scheme == "https" else 80)
    name = f"[{host}]" if ":" in host else host  # IPv6 literal
    headers = {"Host": name if default_port else f"{name}:{port}"}
    ext = {"sni_hostname": host} if parts.scheme == "https" else {}  # TLS checks the real name
    return pinned, headers, ext


def _status_check(r: Any, max_bytes: int) -> None:
    if r.status_code != 200:
        raise MediaError(f"fetching media failed with HTTP status {r.status_code}")
    size = r.headers.get("content-length", "")
    if size.isdigit() and int(size) > max_bytes:
        raise MediaError(f"media is larger than the {max_bytes} byte limit (--max-media-bytes)")


def _append_capped(buf: bytearray, chunk: bytes, max_bytes: int, deadline: float,
                   timeout_s: float) -> None:
    buf += chunk
    if len(buf) > max_bytes:
        raise MediaError(f"media is larger than the {max_bytes} byte limit (--max-media-bytes)")
    if time.monotonic() > deadline:
        raise _timed_out(timeout_s)


def _timed_out(timeout_s: float) -> MediaError:
    return MediaError(f"fetching media took longer than {timeout_s:g} s (--media-fetch-timeout)")


def fetch_bytes(url: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """GET an http(s) URL under the caps; every redirect hop is checked again. Each network
    wait is bounded by the time left, and the body by the deadline between chunks."""
    import httpx

    t = limits.fetch_timeout_s
    deadline = time.monotonic() + t
    with httpx.Client(follow_redirects=False, trust_env=False) as client:  # no env proxies
        for _ in range(limits.max_redirects + 1):
            target, headers, ext = plan_hop(url, limits)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timed_out(t)
            try:
                with client.stream("GET", target, headers=headers, extensions=ext,
                                   timeout=left) as r:
                    if r.is_redirect:
                        url = urljoin(url, r.headers.get("location", ""))
                        continue
                    _status_check(r, max_bytes)
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        _append_capped(buf, chunk, max_bytes, deadline, t)
                    return bytes(buf)
            except httpx.TimeoutException:
                raise _timed_out(t) from None
            except httpx.HTTPError:
                raise MediaError("fetching media failed (network error)") from None
    raise MediaError("too many redirects while fetching media")


async def afetch_bytes(url: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """`fetch_bytes` for event loops, under one hard deadline for the whole fetch (name
    resolution, which runs in a worker thread, included)."""
    try:
        return await asyncio.wait_for(_afetch(url, limits, max_bytes), limits.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise _timed_out(limits.fetch_timeout_s) from None


async def _afetch(url: str, limits: MediaLimits, max_bytes: int) -> bytes:
    import httpx

    t = limits.fetch_timeout_s
    deadline = time.monotonic() + t
    async with httpx.AsyncClient(timeout=t, follow_redirects=False, trust_env=False) as client:
        for _ in range(limits.max_redirects + 1):
            target, headers, ext = await aplan_hop(url, limits)
            try:
                async with client.stream("GET", target, headers=headers, extensions=ext) as r:
                    if r.is_redirect:
                        url = urljoin(url, r.headers.get("location", ""))
                        continue
                    _status_check(r, max_bytes)
                    buf = bytearray()
                    async for chunk in r.aiter_bytes():
                        _append_capped(buf, chunk, max_bytes, deadline, t)
                    return bytes(buf)
            except httpx.TimeoutException:
                raise _timed_out(t) from None
            except httpx.HTTPError:
                raise MediaError("fetching media failed (network error)") from None
    raise MediaError("too many redirects while fetching media")


def is_remote(src: str) -> bool:
    return urlsplit(src).scheme.lower() in ("http", "https")


def read_media_bytes(src: str, limits: MediaLimits, max_bytes: int) -> bytes:
    """Encoded bytes of a data:, http(s):, file: URL or an allowed absolute local path."""
    if src.startswith("data:"):
        return data_url(src, max_bytes)
    parts = urlsplit(src)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return fetch_bytes(src, limits, max_bytes)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise MediaError("file: URLs must name a local path")
        return local_file(unquote(parts.path), limits, max_bytes)
    if scheme == "" and src.startswith("/"):
        return local_file(src, limits, max_bytes)
    raise MediaError("unsupported media URL (use data:, http(s):, file: or an allowed local path)")


__all__ = ["afetch_bytes", "data_url", "fetch_bytes", "is_remote", "local_file",
           "read_media_bytes"]
