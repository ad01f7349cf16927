"""``kvdepot server`` whose loads stall *inside* their copy (admitted, nothing copied yet) while the
file ``<socket path>.stall`` exists: a server descheduled or stopped at the worst moment, for the
tests that kill it there. Run as a script: ``stalling_server.py --url URL ...``."""

from __future__ import annotations

import os
import sys
import time

from kvdepot.server import shard

_load = shard._load
_url = sys.argv[sys.argv.index("--url") + 1]
STALL_FILE = _url.removeprefix("ipc://") + ".stall"


def _stalled_load(*args, **kwargs):  # type: ignore[no-untyped-def]
    while os.path.exists(STALL_FILE):
        time.sleep(0.01)
    return _load(*args, **kwargs)


shard._load = _stalled_load

if __name__ == "__main__":
    from kvdepot.server.__main__ import main

    sys.exit(main(sys.argv[1:]))
