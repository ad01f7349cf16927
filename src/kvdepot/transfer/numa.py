"""Which host CPUs sit next to a GPU, and running a thread there while it touches memory first.

Host<->GPU copies to or from memory on the other socket's node run markedly slower, and Linux
places a page on the node of the CPU that first touches it (the CUDA driver's pinned allocations
included). So whoever allocates a pinned arena for a GPU does it from that GPU's CPUs
(``near_gpu``); the threads it starts meanwhile keep them. The GPU's CPUs come from sysfs
(``local_cpulist`` of its PCI device): Linux only, and unknown (None) anywhere else.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("kvdepot")
PCI_DEVICES = Path("/sys/bus/pci/devices")


def cpulist(text: str) -> set[int]:
    """A sysfs CPU list (``0-3,8,10-11``) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cuda_index(device: torch.device | int | None) -> int | None:
    """The CUDA device's index (a bare ``cuda`` means the current one); None for any other device."""
    if device is None or isinstance(device, int):
        return device
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def gpu_cpus(device: torch.device | int | None, root: Path = PCI_DEVICES) -> set[int] | None:
    """``local_cpulist`` of the GPU's PCI device in sysfs; None if it cannot be found (or
    ``device`` is not a GPU)."""
    if (device := cuda_index(device)) is None:
        return None
    try:
        props = torch.cuda.get_device_properties(device)
        ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
        if None in ids:
            from cuda.bindings import runtime

            err, raw = runtime.cudaDeviceGetPCIBusId(64, device)
            bus_id = bytes(raw).split(b"\0")[0].decode().lower() if int(err) == 0 else ""
        else:
            bus_id = f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
        return cpulist((root / bus_id / "local_cpulist").read_text()) or None
    except (ImportError, OSError, ValueError, RuntimeError, TypeError, AttributeError, AssertionError):
        logger.debug("kvdepot: NUMA node of GPU %d unknown", device, exc_info=True)
        return None


@contextlib.contextmanager
def near_gpu(device: torch.device | int | None) -> Iterator[None]:
    """Run on the CPUs of GPU ``device``'s NUMA node (threads started meanwhile keep them), so the
    memory this thread and its children touch first — a pinned arena — sits next to the GPU. The
    calling thread gets its own CPUs back after. No-op for None or a device that is not a GPU,
    where unknown, not Linux, or where the thread may not run there."""
    cpus = gpu_cpus(device) if device is not None and hasattr(os, "sched_setaffinity") else None
    allowed = os.sched_getaffinity(0) if cpus else set()
    near = cpus & allowed if cpus else set()
    if not near or near == allowed:
        yield
        return
    os.sched_setaffinity(0, near)  # this thread only (Linux)
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)
