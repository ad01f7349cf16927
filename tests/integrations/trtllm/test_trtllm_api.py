"""The adapter subclasses TensorRT-LLM's own base classes when TensorRT-LLM imports — from the
old module path (v1.2.x) first, then the new one — and stands alone when it does not.

Each case runs in a fresh interpreter with stub ``tensorrt_llm`` modules on ``sys.path``, the
way a real install would present them, so the import order is exercised for real.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OLD = "tensorrt_llm._torch.pyexecutor.kv_cache_connector"
NEW = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"

STUB = textwrap.dedent(
    """
    from abc import ABC, abstractmethod
    from dataclasses import dataclass, field
    MARK = "{mark}"
    @dataclass
    class RequestData:
        request_id: int
        new_tokens: list
        new_block_ids: list
        computed_position: int
        num_scheduled_tokens: int
    @dataclass
    class SchedulerOutput:
        new_requests: list = field(default_factory=list)
        cached_requests: list = field(default_factory=list)
    class KvCacheConnectorWorker(ABC):
        def __init__(self, llm_args):
            self._llm_args = llm_args
            self._metadata = None
        def bind_connector_meta(self, metadata):
            self._metadata = metadata
        @abstractmethod
        def register_kv_caches(self, kv_cache_tensor): ...
    class KvCacheConnectorScheduler(ABC):
        def __init__(self, llm_args):
            self._llm_args = llm_args
        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens): ...
    """
)


def _write_stub(root: Path, dotted: str, mark: str) -> None:
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        pkg = root.joinpath(*parts[:i])
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
    root.joinpath(*parts[:-1], parts[-1] + ".py").write_text(STUB.format(mark=mark))


def _probe(path: Path | None) -> str:
    code = textwrap.dedent(
        """
        import kvdepot
        from kvdepot.integrations.tensorrt_llm import api
        from kvdepot.integrations.tensorrt_llm.adapter import KvDepotConnectorScheduler, KvDepotConnectorWorker
        mark = getattr(__import__(api.KvCacheConnectorWorker.__module__, fromlist=["x"]), "MARK", "fallback")
        assert issubclass(KvDepotConnectorWorker, api.KvCacheConnectorWorker)
        assert issubclass(KvDepotConnectorScheduler, api.KvCacheConnectorScheduler)
        print(api.HAVE_TRTLLM, api.TRTLLM_MODULE_PATH, mark)
        """
    )
    env_path = [str(path)] if path else []
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:0] = {env_path!r}\n" + code],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_without_tensorrt_llm_uses_fallbacks() -> None:
    assert _probe(None) == "False None fallback"


def test_old_path_is_preferred(tmp_path: Path) -> None:
    _write_stub(tmp_path, OLD, "old")
    _write_stub(tmp_path, NEW, "new")
    assert _probe(tmp_path) == f"True {OLD} old"


def test_new_path_when_old_is_gone(tmp_path: Path) -> None:
    _write_stub(tmp_path, NEW, "new")
    assert _probe(tmp_path) == f"True {NEW} new"


def test_core_never_imports_the_integration() -> None:
    code = "import sys, kvdepot, kvdepot.engine; print(any(m.startswith('kvdepot.integrations') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("name", ["KvDepotConnectorScheduler", "KvDepotConnectorWorker"])
def test_adapter_classes_are_importable_by_name(name: str) -> None:
    import importlib

    module = importlib.import_module("kvdepot.integrations.tensorrt_llm.adapter")
    assert isinstance(getattr(module, name), type)
