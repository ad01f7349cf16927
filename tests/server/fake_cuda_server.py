"""``kvdepot server`` whose CUDA IPC mapping is a stand-in (no GPU here): a REGISTER of a CUDA pool
with layer events succeeds, and everything around it — the progress page it names, the session,
its close — is the real server's. Run as a script: ``fake_cuda_server.py --url URL ...``."""

from __future__ import annotations

import sys

from kvdepot.server import ipc


def _map_cuda(desc, nbytes, shape, dtype):  # type: ignore[no-untyped-def]
    return ipc.MappedPool("cuda", layer_events=[None] * len(desc.layer_events))


ipc._map_cuda = _map_cuda

if __name__ == "__main__":
    from kvdepot.server.__main__ import main

    sys.exit(main(sys.argv[1:]))
