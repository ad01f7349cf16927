"""Where the server listens: a per-user ``ipc://`` socket by default, TCP only when asked for.

    default_url()          ipc://$XDG_RUNTIME_DIR/kvdepot/server.sock, else /tmp/kvdepot-<uid>/server.sock
    tcp_url(port, host)    tcp://127.0.0.1:<port> unless a host is given
    ipc_path(url)          the socket file of an ipc:// URL, or None
    check_url(url)         refuse what ZMQ would misread (unknown scheme, a too-long socket path)

The default directory is created with mode 0700 and must be owned by the current user and not
writable by anyone else; a directory that fails those checks is an error, never used.
"""

from __future__ import annotations

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
