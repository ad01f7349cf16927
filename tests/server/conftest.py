"""Fixtures of the server tests (GPU items are skipped without CUDA by tests/conftest.py)."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # mp_helpers, for tests and client subprocesses

from mp_helpers import short_dir, start_server, stop_server  # noqa: E402


@pytest.fixture
def workdir():
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server_url():
    """One server subprocess shared by a module's tests (session timeout 1 s)."""
    path = short_dir()
    url = f"ipc://{path}/s.sock"
    proc = start_server(url, "--session-timeout-s", "1")
    yield url
    stop_server(proc)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _kvdepot_log_level():
    """``kvdepot server``'s ``main`` sets the kvdepot logger's level from --log-level: give the next tests theirs back."""
    log = logging.getLogger("kvdepot")
    level = log.level
    yield
    log.setLevel(level)
