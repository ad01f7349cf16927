"""The package's import graph: layers import downward only, and nothing imports in a cycle.

Module-level imports only (imports inside functions are lazy by design, e.g. the CLI's), and not
the ones under ``TYPE_CHECKING`` (annotations, never run). The layers are docs/architecture.md's.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "kvdepot"
LAYERS = {  # top-level module or package -> layer; a module may import only from its layer or below
    "": 0, "errors": 0, "config": 0, "keys": 0, "layout": 0, "engine_api": 0,
    "transfer": 1, "storage": 2, "events": 2, "results": 3, "engine": 3, "engine_loads": 3,
    "server": 4, "integrations": 5, "runtime": 6, "bench": 7, "demo": 7, "checks": 7, "cli": 8, "__main__": 9,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("kvdepot", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        mods[name] = path
    return mods


def _runtime_imports(path: Path, mods: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        nodes = [node]
        if isinstance(node, ast.If):
            nodes = [] if "TYPE_CHECKING" in ast.unparse(node.test) else node.body + node.orelse
        elif isinstance(node, ast.Try):
            nodes = node.body
        for n in nodes:
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("kvdepot"):
                found |= {f"{n.module}.{a.name}" for a in n.names} & mods.keys()
                found |= {n.module} & mods.keys()
            elif isinstance(n, ast.Import):
                found |= {a.name for a in n.names} & mods.keys()
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def test_every_module_has_a_layer() -> None:
    assert all(m.split(".")[1] in LAYERS for m in _modules() if m != "kvdepot")


def test_layers_import_downward_only() -> None:
    mods = _modules()
    upward = [(m, t) for m, path in mods.items() for t in _runtime_imports(path, mods) if _layer(t) > _layer(m)]
    assert upward == []


def test_no_import_cycle() -> None:
    mods = _modules()
    graph = {m: {t for t in _runtime_imports(p, mods) if not t.startswith(m + ".")} for m, p in mods.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        stack.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])
    assert cycles == []


def test_the_engine_imports_where_torch_cuda_event_is_a_placeholder() -> None:
    """vLLM's CPU worker replaces ``torch.cuda.Event`` with a placeholder before it imports a KV
    connector (``vllm/v1/worker/cpu/shm.py``): nothing of ours may touch the class at import. (An
    import-time ``torch.cuda.Event.record`` once made vLLM report the connector class missing.)"""
    import subprocess
    import sys

    code = ("import torch; torch.cuda.Event = type('Placeholder', (), {}); "
            "import kvdepot.engine, kvdepot.transfer.streams, kvdepot.server.client, kvdepot.integrations.vllm.layout")
    env = {"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
