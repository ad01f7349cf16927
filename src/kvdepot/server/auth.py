"""CURVE for tcp:// servers: who may connect, and nobody on the wire reads or forges KV.

    write_keys(dir)                         ``kvdepot keys DIR``: a server and a client key pair
    server_curve(url, dir, insecure=) -> ServerCurve | None   the server's keys, or refuse plain TCP
    client_curve(url, dir) -> ClientCurve | None              a client's keys for a tcp:// URL
    ServerCurve.secure(ctx, socket) -> stop()                 before bind: CURVE server + ZAP allow list
    ClientCurve.secure(socket)                                before connect

libzmq's CURVE (CurveZMQ: Curve25519 key exchange, every frame encrypted and authenticated) with
pyzmq's ``zmq.auth`` as the ZAP handler, so a client is admitted only if its public key is in
the server's allow list — no scheme of our own. ``kvdepot keys DIR`` lays out one directory:

    DIR/server.key                  server public key          -> every client
    DIR/server.key_secret           server key pair            -> the server only
    DIR/client.key_secret           client key pair            -> every client
    DIR/authorized_clients/*.key    public keys let in         -> the server only

On one machine the same ``DIR`` serves both sides (``server_curve_dir``); for clients on another
host copy ``server.key`` and ``client.key_secret`` there. To let another client in, put its
``*.key`` (public) file in ``authorized_clients/`` and restart the server. Only tcp:// uses
CURVE: an ipc:// socket is reachable by its owner alone (file mode 0600, directory 0700).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvdepot.errors import ConfigError

logger = logging.getLogger("kvdepot")

SERVER, CLIENT, ALLOWED = "server", "client", "authorized_clients"
_DOMAIN = "kvdepot"  # the ZAP domain of the server socket; its allow list is configured for it
_HOW = "run `kvdepot keys DIR` and set server_curve_dir (--server-curve-dir or KVDEPOT_SERVER_CURVE_DIR)"


@dataclass(frozen=True)
class ServerCurve:
    public: bytes
    secret: bytes
    allowed: Path  # directory of the clients' public key files

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> Callable[[], None]:
        """Make ``sock`` (not yet bound) a CURVE server that admits the allowed keys only; returns
        the function that stops the authenticator (before ``ctx.term``)."""
        authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("kvdepot.zap"))
        authenticator.start()
        authenticator.configure_curve(domain=_DOMAIN, location=str(self.allowed))
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, _DOMAIN.encode())
        return authenticator.stop


@dataclass(frozen=True)
class ClientCurve:
    public: bytes
    secret: bytes
    server: bytes  # the server's public key: a server without its secret cannot answer

    def secure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def write_keys(directory: str | Path) -> list[Path]:
    """Create ``directory`` (0700) with a server and a client key pair; refuses to overwrite keys."""
    root = Path(directory)
    if (root / f"{SERVER}.key_secret").exists() or (root / f"{CLIENT}.key_secret").exists():
        raise ConfigError(f"{root} already holds kvdepot keys; remove them first or choose another directory")
    old = os.umask(0o077)  # zmq.auth writes with the process umask: no moment where a secret is readable
    try:
        (root / ALLOWED).mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        zmq.auth.create_certificates(root, SERVER)
        client_public, _ = zmq.auth.create_certificates(root, CLIENT)
        shutil.copyfile(client_public, root / ALLOWED / f"{CLIENT}.key")
    finally:
        os.umask(old)
    return sorted(p for p in root.rglob("*") if p.is_file())


def server_curve(url: str, directory: str | None, *, insecure: bool = False) -> ServerCurve | None:
    """The server's keys for a tcp:// ``url``; None for ipc:// or ``insecure``. Plain TCP without
    ``insecure`` is refused: anyone who can connect could read and poison every engine's KV."""
    if not url.startswith("tcp://"):
        return None
    if not directory:
        if insecure:
            logger.warning("kvdepot server: %s has no authentication or encryption (--insecure)", url)
            return None
        raise ConfigError(f"{url} would be open to anyone who can connect: {_HOW}, or pass --insecure")
    root = Path(directory)
    public, secret = _pair(root / f"{SERVER}.key_secret")
    if not (root / ALLOWED).is_dir() or not any((root / ALLOWED).glob("*.key")):
        raise ConfigError(f"server_curve_dir {root}: no client public keys in {root / ALLOWED}/ ({_HOW})")
    return ServerCurve(public, secret, root / ALLOWED)


def client_curve(url: str, directory: str | None) -> ClientCurve | None:
    """A client's keys for a tcp:// ``url``, or None (ipc://, or no ``server_curve_dir``: plain)."""
    if not url.startswith("tcp://") or not directory:
        return None
    root = Path(directory)
    public, secret = _pair(root / f"{CLIENT}.key_secret")
    server, _ = _load(root / f"{SERVER}.key")
    return ClientCurve(public, secret, server)


def _pair(path: Path) -> tuple[bytes, bytes]:
    """A key pair from a ``.key_secret`` file that is ours and readable by nobody else."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"server_curve_dir: cannot read {path}: {exc.strerror} ({_HOW})") from None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(f"server_curve_dir: {path} must be owned by uid {os.getuid()} and private "
                          f"(mode {stat.filemode(info.st_mode)}); chmod 600 it")
    public, secret = _load(path)
    if secret is None:
        raise ConfigError(f"server_curve_dir: {path} holds no secret key")
    return public, secret


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"server_curve_dir: cannot load the key in {path}: {exc} ({_HOW})") from None


def config_curve_dir() -> str | None:
    """``server_curve_dir`` from kvdepot's config (file and environment): a client's default."""
    from kvdepot.config import load_config

    return load_config().server_curve_dir
