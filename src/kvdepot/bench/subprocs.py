"""Ending a bench's child process: ``wait_or_kill(proc, timeout_s)``, ``terminate(proc, timeout_s)``.

A bench asks its children to stop (a signal, a message, a file) and must neither hang on one that
does not nor leave one behind: wait so long, then kill. (``bench soak`` kills its own way: its
children may be SIGSTOPped and get a SIGCONT first.)
"""

from __future__ import annotations

import contextlib
import signal
import subprocess


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> int:
    """``proc``'s exit code once it has ended: within ``timeout_s`` of being asked, else killed."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def terminate(proc: subprocess.Popen, timeout_s: float) -> int:
    """``wait_or_kill`` after a SIGTERM (a child that may have exited already: nothing to signal)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    return wait_or_kill(proc, timeout_s)
