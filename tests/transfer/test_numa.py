"""Arenas are pinned next to their GPU: its NUMA-local CPUs are found and inherited."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from kvdepot.transfer import numa

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")


def test_threads_started_near_the_gpu_keep_its_cpus(monkeypatch):
    allowed = os.sched_getaffinity(0)
    near = {min(allowed)}
    monkeypatch.setattr(numa, "gpu_cpus", lambda device: near)
    seen: dict[str, set[int]] = {}
    with numa.near_gpu(0):
        seen["inside"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getaffinity(0)))
        child.start()
        child.join()
    assert seen == {"inside": near, "child": near}
    assert os.sched_getaffinity(0) == allowed  # the registering thread gets its CPUs back
    with numa.near_gpu(None):  # not a CUDA pool: nothing changes
        assert os.sched_getaffinity(0) == allowed


def test_gpu_cpus_from_sysfs(monkeypatch, tmp_path):
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(numa.torch.cuda, "get_device_properties", lambda device: props)
    device_dir = tmp_path / "0000:1b:00.0"
    device_dir.mkdir()
    (device_dir / "local_cpulist").write_text("0-3,8,10-11\n")
    assert numa.gpu_cpus(0, tmp_path) == {0, 1, 2, 3, 8, 10, 11}
    (device_dir / "local_cpulist").unlink()
    assert numa.gpu_cpus(0, tmp_path) is None  # unknown: the arena is allocated wherever the thread runs


def test_only_a_gpu_has_cpus_near_it():
    import torch

    assert numa.cuda_index(3) == 3 and numa.cuda_index(torch.device("cuda", 1)) == 1
    for device in (None, torch.device("cpu"), torch.device("meta")):
        assert numa.cuda_index(device) is None and numa.gpu_cpus(device) is None


def test_cpu_lists_parse():
    assert numa.cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.cpulist("\n") == set()


@pytest.mark.gpu
def test_an_in_process_engine_pins_its_arena_from_the_gpus_cpus(monkeypatch):
    """The arena's pinning thread runs on the GPU's CPUs (where this process may run there), and
    the thread that registered the pool keeps its own. On a host of one NUMA node the GPU's CPUs
    are all of them: one CPU stands in for them there (the engine's CUDA path is the same)."""
    import torch

    from kvdepot.config import load_config
    from kvdepot.engine import CacheEngine

    near, allowed = numa.gpu_cpus(torch.cuda.current_device()), os.sched_getaffinity(0)
    if not near or not near & allowed or near & allowed == allowed:
        near = {min(allowed)}
        monkeypatch.setattr(numa, "gpu_cpus", lambda device: near)
    pool = torch.zeros((64, 2, 2, 512), dtype=torch.bfloat16, device="cuda")
    engine = CacheEngine.for_pool(pool, 16, load_config(chunk_size=64, host_capacity_gb=0.05))
    try:
        pinner = engine._pinner._thread  # this engine's (another test's may still run)
        assert pinner is not None and pinner.is_alive()
        assert os.sched_getaffinity(pinner.native_id) == near & allowed
        assert os.sched_getaffinity(0) == allowed
    finally:
        engine.close()
