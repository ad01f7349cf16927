"""Where a benchmark's threads, GPU and host buffers sit among the host's NUMA nodes.

Printed beside the transfer rows whose figure moved 10+ points from one process to the next on
the same host with the same code (the 256 KiB store, issue 19, twenty-first pass): a process's
CPUs, its pinned arena and the memcpy buffer it is paired with can each land on the GPU's node or
another one, and a row is read against that. Linux only, read-only, and best effort: a fact that
cannot be read (no ``/sys`` node files, a mapping ``move_pages`` cannot see) prints as ``?``.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from kvdepot.transfer.numa import cpulist, gpu_cpus

NODES = Path("/sys/devices/system/node")
MOVE_PAGES = {"x86_64": 279, "aarch64": 239}  # the syscall's number per machine
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def node_cpus(root: Path = NODES) -> dict[int, set[int]]:
    """Each NUMA node's CPUs ({} where the host does not say)."""
    try:
        return {int(d.name[4:]): cpulist((d / "cpulist").read_text())
                for d in root.glob("node[0-9]*") if (d / "cpulist").exists()}
    except (OSError, ValueError):
        return {}


def cpus_text(cpus: set[int], nodes: dict[int, set[int]]) -> str:
    """``0-3 (node 0)``: a CPU set as ranges, with the nodes it spans."""
    runs, ordered = [], sorted(cpus)
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    ranges = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
    spanned = sorted(n for n, members in nodes.items() if members & cpus)
    return f"{ranges} (node {','.join(map(str, spanned)) or '?'})"


def page_nodes(ptr: int, nbytes: int, samples: int = 16) -> Counter[int]:
    """The nodes of ``samples`` pages spread over ``[ptr, ptr+nbytes)`` (``move_pages`` with no
    target: it only reports). Pages it cannot see (a driver's mapping) are left out: an empty
    count means unknown."""
    number = MOVE_PAGES.get(platform.machine())
    if number is None or nbytes <= 0:
        return Counter()
    first, last = ptr // PAGE, (ptr + nbytes - 1) // PAGE
    count = min(samples, last - first + 1)
    pages = (ctypes.c_void_p * count)(*[(first + i * (last - first) // max(1, count - 1)) * PAGE for i in range(count)])
    status = (ctypes.c_int * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(number), 0, ctypes.c_ulong(count), pages, None, status, 0) != 0:
        return Counter()
    return Counter(s for s in status if s >= 0)


def placement(buffers: dict[str, Sequence[torch.Tensor]], device: torch.device) -> str:
    """One line: this process's CPUs and their nodes, the GPU's (its PCI slot's local CPUs), and
    each named buffer's sampled pages by node (a buffer in several allocations: all of them)."""
    nodes = node_cpus()
    gpu = gpu_cpus(device)
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()  # Linux
    parts = [f"CPUs {cpus_text(mine, nodes) if mine else '?'}", f"GPU's CPUs {cpus_text(gpu, nodes) if gpu else '?'}"]
    for name, tensors in buffers.items():
        counts: Counter[int] = Counter()
        for tensor in tensors:
            counts += page_nodes(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        where = " ".join(f"node {n}: {k}" for n, k in sorted(counts.items())) or "?"
        parts.append(f"{name} pages {where}")
    return "; ".join(parts)
