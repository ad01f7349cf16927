"""``kvdepot server`` refuses settings it could not serve with: one line, exit status 2, at start."""

from __future__ import annotations

import socket

import pytest
from mp_helpers import SERVER_ARGS

from kvdepot.config import load_config
from kvdepot.server import __main__ as cli
from kvdepot.server.settings import check_settings

pytestmark = pytest.mark.timeout(60)


def _server(capsys, workdir, *args: str) -> tuple[int, str]:  # noqa: ANN001
    """``kvdepot server`` (its ``main``, in this process: the exit status and stderr it would give)."""
    status = cli.main(["--url", f"ipc://{workdir}/s.sock", *SERVER_ARGS, *args])
    return status, capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, key, words", [
    (("--disk-path", "/proc/kvdepot-x"), "disk_path", "not a writable directory"),
    (("--chunk-size", "100"), "chunk_size", "not a power of two"),
    (("--remote-url", "localhost:6379"), "remote_url", "redis://"),
    (("--remote-url", "redis://127.0.0.1:notaport"), "remote_url", "port"),
    (("--remote-url", "redis://user:hunter2@127.0.0.1:{port}"), "remote_url", "no Redis answers"),
], ids=["disk-path", "chunk-size", "url-scheme", "url-port", "url-unreachable"])
def test_unusable_settings_are_refused_in_one_line(capsys, workdir, args, key, words):
    args = tuple(a.replace("{port}", str(_free_port())) for a in args)
    status, err = _server(capsys, workdir, *args)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and words in lines[0], err
    assert "hunter2" not in err  # a password in the URL is never printed


def test_a_taken_metrics_port_is_named_in_one_line(capsys, workdir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = _server(capsys, workdir, "--metrics-port", str(port), "--log-level", "ERROR")
    assert status == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f":{port} " in lines[0] and "--metrics-port" in lines[0], err


def test_usable_settings_pass(tmp_path, redis_server):
    check_settings(load_config(chunk_size=64, disk_path=str(tmp_path / "new" / "disk"), remote_url=redis_server.url))
    assert (tmp_path / "new" / "disk").is_dir() and not list((tmp_path / "new" / "disk").iterdir())  # no probe file left
