"""CUDA IPC: a pool from a raw cudaMalloc (what TensorRT-LLM's pool is), registered by IPC handle,
stored and loaded by the server — whole, and layer by layer with a layer event each — bit-exact
across processes, ordered by interprocess events. A load by layer is answered early (before its
8 layers are enqueued, or after layer 0 without a progress page: ``server/layer_progress.py``), and two of them
back to back (the second queued behind the first on the shard's issuer) are bit-exact too; the
forward learns of each layer from the progress page (no LAYERS call), or by LAYERS with
``layer_progress: rpc``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mp_helpers import start_server, stop_server

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

OWNER = r"""
import sys
import torch
from cuda.bindings import runtime
from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import _wrap_device_memory
from kvdepot.server.progress_page import PAGE_SUPPORTED
from kvdepot.server.remote import RemoteEngine

url, role, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
B, SHAPE = 32, (64, 8, 2, 8 * 32 * 64)          # 64 blocks of 512 KiB (bf16): 8 layers of 64 KiB parts
torch.cuda.set_device(0)
nbytes = 2
for dim in SHAPE:
    nbytes *= dim
err, ptr = runtime.cudaMalloc(nbytes + 4096)      # a raw allocation, not torch's
assert int(err) == 0, err
flat = _wrap_device_memory(int(ptr), nbytes + 4096, 0)
pool = flat[4096:].view(torch.bfloat16).view(SHAPE)  # the pool starts at an offset in the allocation
gen = torch.Generator(device="cuda").manual_seed(seed)
expected = torch.randn(SHAPE, device="cuda", generator=gen).to(torch.bfloat16)
client = DepotClient(url, timeout_s=10.0, heartbeat_s=0.5)
remote = RemoteEngine(client, pool, B, model_id="gpu-ipc", mode="ipc")
assert remote.ready and remote.exported.kind == "cuda", remote.exported.kind
tokens = [(seed * 131 + i * 7) % 32000 for i in range(8 * B)]   # 4 chunks of 64 = 8 blocks
keys = remote.chunk_keys(tokens)
src, dst, dst2 = list(range(8)), list(range(40, 48)), list(range(24, 32))
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    if role == "store":
        pool.zero_()
        torch.cuda._sleep(200_000_000)                # a long kernel first: the store must wait for it
        pool[src] = expected[src]
        handle = remote.store(keys, src, stream=stream)
        handle.wait()
        assert handle.chunks == 4, handle.chunks
    else:
        pool.zero_()
    assert remote.lookup(keys, lease=1) == 8 * B
    torch.cuda._sleep(200_000_000)                    # the load must wait for earlier work ...
    pool[dst] = 1.0                                   # ... such as this write, or it would be lost
    seen, seen2 = [], []
    if role in ("layered", "layered2", "layered-rpc"):  # copied layer by layer, a forward's waits per layer
        handle = remote.retrieve_async(keys, dst, lease=1, stream=stream, by_layer=True)
        end = handle.result()
        assert handle.layered is not None and handle.layered.num_layers == SHAPE[1], handle.layered
        # Answered before the last layer's event was recorded (the server's issuer enqueues the
        # layers after the reply: all of them with a page, all but layer 0 with layer_progress rpc).
        assert handle.layered.ready_at_reply < SHAPE[1], handle.layered.ready_at_reply
        second = None
        if role == "layered2":                        # a second load before the first is waited for
            second = remote.retrieve_async(keys, dst2, stream=stream, by_layer=True)
            assert second.result() == 8 * B and second.layered is not None
        for layer in range(SHAPE[1]):
            handle.layered.wait_layer(layer, stream)
            seen.append(pool[dst, layer].clone())     # what layer ``layer``'s attention would read
            if second is not None:
                second.layered.wait_layer(layer, stream)
                seen2.append(pool[dst2, layer].clone())
        assert handle.layered.fully_waited
        # Followed through the progress page (x86-64): no LAYERS call; with layer_progress rpc, by LAYERS.
        if role == "layered-rpc" or not PAGE_SUPPORTED:
            assert remote._page is None and remote.layer_stats.asks >= 1, remote.layer_stats
        else:
            assert remote._page is not None and remote.layer_stats.asks == 0, remote.layer_stats
    else:
        end = remote.retrieve(keys, dst, lease=1, stream=stream)
    loaded = pool[dst].clone()                        # on the stream: ordered after the load
stream.synchronize()
assert end == 8 * B, end
assert torch.equal(loaded, expected[src]), "loaded blocks differ"
for layer, snapshot in enumerate(seen):
    assert torch.equal(snapshot, expected[src, layer]), f"layer {layer} read before its copies ended"
for layer, snapshot in enumerate(seen2):
    assert torch.equal(snapshot, expected[src, layer]), f"layer {layer} of the second load read before its copies ended"
if role == "layered2":
    assert torch.equal(pool[dst2].clone(), expected[src]), "the second load's blocks differ"
    assert torch.count_nonzero(pool[8:24]) == 0 and torch.count_nonzero(pool[32:40]) == 0, "a block outside was written"
assert torch.count_nonzero(pool[48:]) == 0, "a block outside the request was written"
client.close()
remote.close()
print("ok", role, flush=True)
"""


def _owner(url: str, role: str, seed: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"KVDEPOT_LAYER_PROGRESS": "rpc"} if role == "layered-rpc" else {})}
    return subprocess.run([sys.executable, "-c", OWNER, url, role, str(seed)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_raw_cudamalloc_pool_by_cuda_ipc(workdir):
    url = f"ipc://{workdir}/g.sock"
    proc = start_server(url, "--chunk-size", "64", "--host-capacity-gb", "0.2")
    try:
        stored = _owner(url, "store", 3)
        assert stored.returncode == 0 and "ok store" in stored.stdout, stored.stderr
        hit = _owner(url, "hit", 3)  # another process, another allocation: loads what the first stored
        assert hit.returncode == 0 and "ok hit" in hit.stdout, hit.stderr
        layered = _owner(url, "layered", 3)  # by layer: the server records each layer's event on its copy stream
        assert layered.returncode == 0 and "ok layered" in layered.stdout, layered.stderr
        twice = _owner(url, "layered2", 3)  # two loads by layer in flight at once on one pool
        assert twice.returncode == 0 and "ok layered2" in twice.stdout, twice.stderr
        rpc = _owner(url, "layered-rpc", 3)  # followed by LAYERS round trips, not the progress page
        assert rpc.returncode == 0 and "ok layered-rpc" in rpc.stdout, rpc.stderr
    finally:
        assert stop_server(proc) == 0, proc.log.read_text()  # type: ignore[attr-defined]
