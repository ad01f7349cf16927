"""The README's and docs/server.md's TensorRT-LLM examples, built against TensorRT-LLM 1.2's config.

Each python example is run with stand-in ``tensorrt_llm`` modules shaped like 1.2's: the config
classes live in ``tensorrt_llm.llmapi.llm_args`` only (``tensorrt_llm.llmapi`` does not export
``KvCacheConnectorConfig``), the connector config is the runtime's strict three-field model, CUDA
graphs are on unless ``cuda_graph_config=None`` (and refused next to a connector), and ``LLM``
imports the connector module and both classes, as the executor creator does. Each YAML example
goes through the same checks as ``--extra_llm_api_options`` would put it.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvdepot.errors import ConfigError
from kvdepot.runtime.connector import resolve_connector_classes
from kvdepot.runtime.llm_args import (
    KvCacheConfig,
    KvCacheConnectorConfig,
    TorchLlmArgs,
    validate_llm_args,
)

ROOT = Path(__file__).resolve().parents[2]
CUDA_GRAPHS_ON = "CudaGraphConfig()"  # 1.2's LLM API turns CUDA graphs on unless told otherwise


def build_llm_args(**kwargs: Any) -> TorchLlmArgs:
    """What 1.2's ``LLM(**kwargs)`` does with a connector before any GPU work."""
    kwargs.setdefault("cuda_graph_config", CUDA_GRAPHS_ON)
    if isinstance(kwargs.get("kv_cache_config"), dict):
        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
    if isinstance(kwargs.get("kv_connector_config"), dict):
        kwargs["kv_connector_config"] = KvCacheConnectorConfig.model_validate(kwargs["kv_connector_config"])
    args = TorchLlmArgs(**kwargs)
    if args.kv_connector_config is not None:
        if not isinstance(args.kv_connector_config, KvCacheConnectorConfig):
            raise ConfigError(f"kv_connector_config must be a KvCacheConnectorConfig, got {args.kv_connector_config!r}")
        validate_llm_args(args, with_connector=True)
        resolve_connector_classes(args)  # imports the module, getattr's both classes
    return args


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = text.find("\n## ", start + len(heading))
    return text[start : following if following >= 0 else len(text)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def readme() -> str:
    return section((ROOT / "README.md").read_text(), "## With TensorRT-LLM")


@pytest.fixture
def trtllm_1_2(monkeypatch: pytest.MonkeyPatch) -> list[TorchLlmArgs]:
    """Stand-in ``tensorrt_llm`` modules with 1.2's export surface; returns the LLMs' arguments."""
    import kvdepot.integrations.tensorrt_llm.adapter  # noqa: F401  (imported before the stand-ins)
    import kvdepot.integrations.tensorrt_llm.mp_adapter  # noqa: F401

    built: list[TorchLlmArgs] = []
    root, llmapi, llm_args = (types.ModuleType(n) for n in (
        "tensorrt_llm", "tensorrt_llm.llmapi", "tensorrt_llm.llmapi.llm_args"))
    root.LLM = lambda **kw: built.append(build_llm_args(**kw))  # type: ignore[attr-defined]
    root.llmapi = llmapi  # type: ignore[attr-defined]
    llmapi.llm_args = llm_args  # type: ignore[attr-defined]
    llmapi.KvCacheConfig = KvCacheConfig  # type: ignore[attr-defined]  # exported; the connector config is not
    llm_args.KvCacheConfig = KvCacheConfig  # type: ignore[attr-defined]
    llm_args.KvCacheConnectorConfig = KvCacheConnectorConfig  # type: ignore[attr-defined]
    for name, module in (("tensorrt_llm", root), ("tensorrt_llm.llmapi", llmapi),
                         ("tensorrt_llm.llmapi.llm_args", llm_args)):
        monkeypatch.setitem(sys.modules, name, module)
    return built


def run_python(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDEPOT_SERVER_URL", raising=False)  # restored after the test: examples set it
    exec(compile(code, "<example>", "exec"), {})


def test_readme_has_the_examples_a_1_2_user_copies():
    text = readme()
    assert len(blocks(text, "python")) >= 1 and len(blocks(text, "yaml")) >= 2
    assert "KVDEPOT_SERVER_URL" in text and "speculative" in text and "tensorrt-llm.md" in text


@pytest.mark.parametrize("doc", ["README.md", "docs/server.md"])
def test_python_examples_build_on_1_2(doc, trtllm_1_2, monkeypatch):
    text = readme() if doc == "README.md" else (ROOT / doc).read_text()
    examples = [c for c in blocks(text, "python") if "kv_connector_config" in c]
    assert examples
    for code in examples:
        run_python(code, monkeypatch)
    assert len(trtllm_1_2) == len(examples)
    assert all(a.kv_connector_config is not None and a.cuda_graph_config is None for a in trtllm_1_2)


def test_yaml_examples_build_on_1_2(trtllm_1_2):
    examples = [yaml.safe_load(c) for c in blocks(readme(), "yaml")]
    assert examples
    for options in examples:
        args = build_llm_args(**options)
        assert args.kv_cache_config.enable_block_reuse


def test_the_checks_refuse_what_1_2_refuses(trtllm_1_2, monkeypatch):
    """The old README's mistakes each fail here, as on 1.2."""
    good = blocks(readme(), "yaml")[0]
    with pytest.raises(ConfigError, match="server_url: Extra inputs are not permitted"):
        build_llm_args(**yaml.safe_load(good + "  server_url: ipc:///tmp/kvdepot.sock\n"))
    with pytest.raises(NotImplementedError, match="CUDA graphs"):
        build_llm_args(**yaml.safe_load(good.replace("cuda_graph_config: null", "")))
    code = blocks(readme(), "python")[0]
    wrong_import = code.replace("from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig",
                                "from tensorrt_llm.llmapi import KvCacheConfig, KvCacheConnectorConfig")
    assert wrong_import != code
    with pytest.raises(ImportError):
        run_python(wrong_import, monkeypatch)
    with pytest.raises(ModuleNotFoundError):
        build_llm_args(**yaml.safe_load(good.replace("tensorrt_llm.adapter", "tensorrt_llm.adaptor")))
