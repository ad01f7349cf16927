"""``bench/numa.py``: the placement line beside the transfer rows reads the host's real layout."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from kvdepot.bench import numa


def test_cpu_lists_parse_and_print_as_ranges(tmp_path):
    for node, cpus in (("node0", "0-3,8\n"), ("node1", "4-7,9-11\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory
    nodes = numa.node_cpus(tmp_path)
    assert nodes == {0: {0, 1, 2, 3, 8}, 1: {4, 5, 6, 7, 9, 10, 11}}
    assert numa.cpus_text({0, 1, 2, 3}, nodes) == "0-3 (node 0)"
    assert numa.cpus_text({3, 4, 9, 11}, nodes) == "3-4,9,11 (node 0,1)"
    assert numa.cpus_text({40}, nodes) == "40 (node ?)"
    assert numa.node_cpus(tmp_path / "absent") == {}


def test_pages_of_a_touched_buffer_are_on_this_hosts_nodes():
    buffer = torch.ones(64 * numa.PAGE, dtype=torch.uint8)  # every page written: every page placed
    counts = numa.page_nodes(buffer.data_ptr(), buffer.numel(), samples=16)
    if not counts and ctypes.get_errno() in (errno.EPERM, errno.ENOSYS):
        pytest.skip("move_pages is not permitted in this sandbox (seccomp)")
    assert sum(counts.values()) == 16
    assert set(counts) <= set(numa.node_cpus()) or not numa.node_cpus()


def test_the_line_names_this_process_cpus():
    buffer = torch.ones(8 * numa.PAGE, dtype=torch.uint8)
    line = numa.placement({"arena": [buffer, buffer[: numa.PAGE]]}, torch.device("cpu"))
    first = min(os.sched_getaffinity(0))
    assert line.startswith(f"CPUs {first}")
    assert "; GPU's CPUs ?; arena pages " in line
