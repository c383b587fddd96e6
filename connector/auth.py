"""ZMQ CURVE with operator-given keys: encryption plus an allow-list of client keys.

Key directory (made by ``triptych keys DIR --names router,prefill-0,decode-0``):

    DIR/private/<name>.key_secret   one node's keypair; 0600 in a 0700 directory; copy each
                                    only to the host that runs that node
    DIR/public/<name>.key           every node's public key; copy the folder to every host

A server socket admits exactly the clients whose public keys it is given (by default every
key in public/, i.e. cluster membership; delete a file to revoke). A client must know the
server's public key, so it cannot be talked into a man in the middle.

    keys = load_keys(DIR, "router")
    auth = secure_server(sock, keys, keys.peers.values())   # before sock.bind(...)
    ...; sock.close(); auth.close()                          # before ctx.term()
    secure_client(sock, keys, server_public_key)             # before sock.connect(...)
"""
from __future__ import annotations

import itertools
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.auth

from .envelope import ConnectorError
from .zap import ZapHandler


@dataclass(frozen=True)
class Keys:
    name: str  # this node's name (the key file's stem)
    public: bytes  # this node's public key, z85 (40 bytes)
    secret: bytes  # its secret key, z85
    peers: dict[str, bytes]  # name -> public key (z85) of every node in DIR/public


def _check_private(path: str, want_dir: bool) -> None:
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or st.st_uid != os.getuid():
        kind = "directory" if want_dir else "file"
        raise ConnectorError(f"secret key {kind} {path} must be owned by this user and not "
                             "readable by group or others (chmod 700 the folder, 600 the file)")


def _check_public(path: str) -> None:
    """Like ssh with authorized_keys: a public key (or its folder) that another user could
    replace would let that user in. Owned by this user (or root), not group/world-writable."""
    st = os.stat(path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid not in (os.getuid(), 0):
        raise ConnectorError(f"public key {'folder' if os.path.isdir(path) else 'file'} "
                             f"{path} must be owned by this user (or root) and writable by "
                             "no one else (chmod go-w); refusing to trust it")


def generate_keys(directory: str, names: Iterable[str]) -> list[str]:
    """Make a keypair per name in ``directory`` (refusing to overwrite); return the paths."""
    names = list(names)
    if not names or any(not n or not n.replace("-", "").replace("_", "").isalnum()
                        for n in names):
        raise ConnectorError("key names are letters, digits, - and _")
    priv, pub = os.path.join(directory, "private"), os.path.join(directory, "public")
    os.makedirs(pub, exist_ok=True)
    os.makedirs(priv, mode=0o700, exist_ok=True)
    os.chmod(priv, 0o700)
    made = []
    for n in names:
        if os.path.exists(os.path.join(priv, f"{n}.key_secret")):
            raise ConnectorError(f"a key named {n!r} already exists in {directory}")
    for n in names:
        scratch = tempfile.mkdtemp(dir=priv)  # inside the 0700 folder from the start
        try:
            public_file, secret_file = zmq.auth.create_certificates(scratch, n)
            os.chmod(secret_file, 0o600)
            os.replace(secret_file, os.path.join(priv, f"{n}.key_secret"))
            os.replace(public_file, os.path.join(pub, f"{n}.key"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        made += [os.path.join(priv, f"{n}.key_secret"), os.path.join(pub, f"{n}.key")]
    return made


def load_keys(directory: str, name: str) -> Keys:
    """This node's keypair and every public key of the cluster."""
    priv = os.path.join(directory, "private")
    secret_file = os.path.join(priv, f"{name}.key_secret")
    if not os.path.isfile(secret_file):
        raise ConnectorError(f"no secret key {secret_file}")
    _check_private(priv, True)
    _check_private(secret_file, False)
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ConnectorError(f"{secret_file} holds no secret key")
    peers = {}
    pub = os.path.join(directory, "public")
    if os.path.isdir(pub):
        _check_public(pub)
    for f in sorted(os.listdir(pub)) if os.path.isdir(pub) else []:
        if f.endswith(".key"):
            _check_public(os.path.join(pub, f))
            peers[f[:-4]] = zmq.auth.load_certificate(os.path.join(pub, f))[0]
    return Keys(name, public, secret, peers)


class ServerAuth:
    """The allow-list of one CURVE server socket; close it after closing the socket."""

    _domains = itertools.count()

    def __init__(self, handler: ZapHandler, domain: str) -> None:
        self._handler, self.domain = handler, domain

    def allow(self, client_keys: Iterable[bytes]) -> None:
        """Replace the allowed client keys (z85); takes effect for new connections."""
        self._handler.set_allowed(self.domain, client_keys)

    def close(self) -> None:
        if self._handler is not None:
            self._handler.release(self.domain)
            self._handler = None  # type: ignore[assignment]


def secure_server(sock: zmq.Socket, keys: Keys, allowed_clients: Iterable[bytes]) -> ServerAuth:
    """Make ``sock`` a CURVE server admitting only ``allowed_clients``. Call before bind."""
    domain = f"triptych-{os.getpid()}-{next(ServerAuth._domains)}"
    handler = ZapHandler.acquire(sock.context, domain, allowed_clients)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    # NOTE: without a ZAP handler a CURVE server admits any client key; enforcing the
    # domain makes a missing handler refuse everyone instead (fail closed).
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return ServerAuth(handler, domain)


def secure_client(sock: zmq.Socket, keys: Keys, server_public_key: bytes) -> None:
    """Make ``sock`` a CURVE client of the server with that public key. Call before
    connect."""
    if len(server_public_key) != 40:
        raise ConnectorError("a CURVE public key is 40 z85 characters")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
