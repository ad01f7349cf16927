"""Both directions at once (H2D on one stream, D2H on another) as one copy per direction vs the same
bytes in many smaller copies: is the bidirectional ceiling a property of the copy size?

    python tools/bidir_granularity.py [--mib 1024]
"""
import argparse
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, default=1024)
a = ap.parse_args()
n = a.mib << 20
h_up = torch.empty(n, dtype=torch.uint8, pin_memory=True)
h_down = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d_up = torch.empty(n, dtype=torch.uint8, device="cuda")
d_down = torch.empty(n, dtype=torch.uint8, device="cuda")
up, down = torch.cuda.Stream(), torch.cuda.Stream()


def run(piece: int, directions: str) -> float:
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for off in range(0, n, piece):
            if "u" in directions:
                with torch.cuda.stream(up):
                    d_up[off : off + piece].copy_(h_up[off : off + piece], non_blocking=True)
            if "d" in directions:
                with torch.cuda.stream(down):
                    h_down[off : off + piece].copy_(d_down[off : off + piece], non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return len(directions) * n / times[3] / 1e9


for piece_mib in (a.mib, 64, 32, 8, 4, 1):
    piece = piece_mib << 20
    print(f"copies of {piece_mib:5d} MiB: H2D {run(piece, 'u'):6.1f}  D2H {run(piece, 'd'):6.1f}  "
          f"both {run(piece, 'ud'):6.1f} GB/s")
