"""Suite-wide pytest hooks.

Items marked ``gpu`` need a CUDA device: without one they are skipped at collection, with the
reason in the report, so the CPU-only CI run stays green and the same files run on a GPU host.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
