"""Host-side cost of issuing N block copies (pinned host <-> CUDA): a Python loop of copy_ vs one
torch._foreach_copy_. Prints microseconds per copy (issue only, then with the copies' completion).

    python tools/issue_cost.py [--blocks 256] [--block-kib 4096]
"""
import argparse
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--blocks", type=int, default=256)
ap.add_argument("--block-kib", type=int, default=4096)
a = ap.parse_args()
n, size = a.blocks, a.block_kib * 1024
pool = torch.empty(n * 2, size, dtype=torch.uint8, device="cuda")
host = torch.empty(n, size, dtype=torch.uint8, pin_memory=True)
ids = torch.randperm(n * 2)[:n].tolist()


def loop():
    for i, b in enumerate(ids):
        host[i : i + 1].copy_(pool[b : b + 1], non_blocking=True)


def foreach():
    torch._foreach_copy_([host[i : i + 1] for i in range(n)], [pool[b : b + 1] for b in ids], non_blocking=True)


for name, fn in (("python loop", loop), ("foreach", foreach)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    issue, total = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append(t1 - t0)
        total.append(t2 - t0)
    issue.sort(), total.sort()
    print(f"{name:12s} {n} copies of {a.block_kib} KiB: issue {issue[5] / n * 1e6:.1f} us/copy "
          f"({issue[5] * 1e3:.2f} ms), issue+complete {total[5] * 1e3:.2f} ms = {n * size / total[5] / 1e9:.1f} GB/s")
