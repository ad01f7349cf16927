"""A small private file a client makes and its server maps beside a registration's pool.

    create(prefix, size, error) -> (path, fd)      client: a fresh 0600 file of ``size`` zero bytes
    open_checked(path, prefix, size, error) -> fd  server: the same file, checked through the
                                                   descriptor it will map or lock

Why checked: REGISTER names the file, so a client could name any file of the server's user. The
server opens only a name with its ``prefix``, never through a symlink, and only a regular file of
its own user of exactly ``size`` bytes (the caller checks the content: zeros, when fresh). Both
the progress page and the copy fence are such files.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile

from kvdepot.errors import KVDepotError


class SharedFileError(KVDepotError):
    """A registration's shared file could not be made, opened or checked."""


def directory() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def create(prefix: str, size: int, error: type[SharedFileError] = SharedFileError) -> tuple[str, int]:
    """A new file named ``prefix``-pid-random, ``size`` zero bytes; the caller closes ``fd``."""
    path = os.path.join(directory(), f"{prefix}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise error(f"cannot create {path!r}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise error(f"cannot size {path!r}: {exc.strerror}") from None
    return path, fd


def open_checked(path: str, prefix: str, size: int, error: type[SharedFileError] = SharedFileError) -> int:
    """``path`` opened read-write once checked (see the module docstring); the caller closes it."""
    if not os.path.basename(path).startswith(prefix):
        raise error(f"{path[:256]!r} is not named {prefix}*")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"cannot open {path[:256]!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise error(f"cannot stat {path[:256]!r}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != size:
        os.close(fd)
        raise error(f"{path[:256]!r} must be a regular file of the server's user, {size} bytes long")
    return fd
