"""Shards pin their host arena next to their GPU: the NUMA-local CPUs are found and inherited."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from kvdepot.server import shard

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")


def test_threads_started_near_the_gpu_keep_its_cpus(monkeypatch):
    allowed = os.sched_getaffinity(0)
    near = {min(allowed)}
    monkeypatch.setattr(shard, "_gpu_cpus", lambda device: near)
    seen: dict[str, set[int]] = {}
    with shard._near_gpu(0):
        seen["inside"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getaffinity(0)))
        child.start()
        child.join()
    assert seen == {"inside": near, "child": near}
    assert os.sched_getaffinity(0) == allowed  # the registering thread gets its CPUs back
    with shard._near_gpu(None):  # not a CUDA pool: nothing changes
        assert os.sched_getaffinity(0) == allowed


def test_gpu_cpus_from_sysfs(monkeypatch, tmp_path):
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(shard.torch.cuda, "get_device_properties", lambda device: props)
    device_dir = tmp_path / "0000:1b:00.0"
    device_dir.mkdir()
    (device_dir / "local_cpulist").write_text("0-3,8,10-11\n")
    real_path = shard.Path
    monkeypatch.setattr(shard, "Path", lambda p: real_path(str(p).replace("/sys/bus/pci/devices", str(tmp_path))))
    assert shard._gpu_cpus(0) == {0, 1, 2, 3, 8, 10, 11}
    (device_dir / "local_cpulist").unlink()
    assert shard._gpu_cpus(0) is None  # unknown: the arena is allocated wherever the thread runs
