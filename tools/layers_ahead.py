"""Full and partial hits with layered loads enqueued N layers ahead of the forward
(``transfer.layered.LAYERS_AHEAD``), alternating values in one process (CUDA only).

    python tools/layers_ahead.py [--lengths 4096,32768] [--ahead 4,64] [--rounds 2]

64 (more than any model's layers) is the up-front variant: every layer enqueued in
``start_load_kv``. Prints hit minus device hit per run (the load's cost over the same forward with
the KV already on the GPU), and partial hit minus its suffix-only floor.
"""
import argparse

import torch

import kvdepot.transfer.inflight as inflight
import kvdepot.transfer.layered as layered
from kvdepot.bench import ttft
from kvdepot.bench.common import memcpy_ceiling

ap = argparse.ArgumentParser()
ttft.add_arguments(ap)
ap.add_argument("--ahead", default="4,64")
ap.add_argument("--rounds", type=int, default=2)
a = ap.parse_args()
lengths = [int(x) for x in a.lengths.split(",")]
h2d = memcpy_ceiling(256 << 20, torch.device("cuda"), 5)[0]
for _ in range(a.rounds):
    for ahead in (int(x) for x in a.ahead.split(",")):
        layered.LAYERS_AHEAD = inflight.LAYERS_AHEAD = ahead  # inflight enqueues the first ones
        for r in ttft._hits(a, lengths, h2d, "in-process"):
            print(f"ahead {ahead:3d} prompt {r['prompt']:6d}: hit {r['kvdepot hit ms']:7.1f} ms, device hit "
                  f"{r['device hit ms']:7.1f}, hit - device {r['kvdepot hit ms'] - r['device hit ms']:6.1f}; partial "
                  f"{r['+1024 partial hit ms']:7.1f}, floor {r['suffix only ms']:7.1f}, partial - floor "
                  f"{r['+1024 partial hit ms'] - r['suffix only ms']:6.1f}; by layer {r['by layer']}", flush=True)
