"""Where the server listens: a per-user ``ipc://`` socket by default, TCP only when asked for.

    default_url()          ipc://$XDG_RUNTIME_DIR/kvdepot/server.sock, else /tmp/kvdepot-<uid>/server.sock
    tcp_url(port, host)    tcp://127.0.0.1:<port> unless a host is given
    ipc_path(url)          the socket file of an ipc:// URL, or None
    check_url(url)         refuse what ZMQ would misread (unknown scheme, a too-long socket path)
    open_private(path)     a file of ours, 0600, opened without following a symlink (the lock file)
    check_socket(path)     the socket ZMQ just bound is ours, 0600, and not a symlink

The default directory is created with mode 0700 and must be owned by the current user and not
writable by anyone else; a directory that fails those checks is an error, never used. The lock
and socket files may live in a directory others can write to (``--url ipc:///shared/x.sock``):
a symlink planted there must never make the server truncate or chmod a file it points to.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvdepot.errors import ConfigError

SOCKET_NAME = "server.sock"
_MAX_IPC_PATH = 107  # sun_path is 108 bytes including the terminating NUL


def runtime_dir() -> Path:
    """The per-user directory of the default socket, created 0700 if missing, checked if present."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        path = Path(xdg) / "kvdepot"
    else:
        path = Path("/tmp") / f"kvdepot-{os.getuid()}"
    ensure_private_dir(path)
    return path


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` 0700, or check that an existing one is ours and private (no symlink)."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} exists and is not a directory; remove it or pass --url")
    if info.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); pass --url")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


def default_url() -> str:
    return f"ipc://{runtime_dir() / SOCKET_NAME}"


def tcp_url(port: int, host: str = "127.0.0.1") -> str:
    if not 0 < port < 65536:
        raise ConfigError(f"TCP port {port} is out of range 1..65535")
    return f"tcp://{host}:{port}"


def ipc_path(url: str) -> Path | None:
    return Path(url[len("ipc://") :]) if url.startswith("ipc://") else None


def check_url(url: str) -> str:
    if url.startswith("ipc://"):
        path = url[len("ipc://") :]
        if not path:
            raise ConfigError("ipc:// URL without a path")
        if len(os.fsencode(path)) > _MAX_IPC_PATH:
            raise ConfigError(f"ipc socket path {path!r} is longer than {_MAX_IPC_PATH} bytes; choose a shorter one")
        return url
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"TCP URL {url!r} must look like tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)")
        return url
    raise ConfigError(f"server URL {url!r}: expected ipc://PATH or tcp://HOST:PORT")


def open_private(path: Path) -> int:
    """A read-write fd of ``path``, created 0600; refused if it is a symlink, not a regular file,
    or someone else's. ``O_NOFOLLOW`` makes the open itself fail on a symlink, so there is no
    window between a check and the open; the checks after it run on the opened descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise ConfigError(f"cannot open {path}: {why}; remove it or pass another --url") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise ConfigError(f"{path} must be a regular file owned by uid {os.getuid()}; remove it or pass another --url")
    if info.st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def check_socket(path: Path) -> None:
    """Refuse a socket path that is not (any more) the private socket we bound: a symlink or a
    file swapped in after ``bind``, another owner, or a mode open to others."""
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(f"{path} is not a private socket of uid {os.getuid()} after bind "
                          f"(mode {stat.filemode(info.st_mode)}, uid {info.st_uid}); someone else writes to its directory")
