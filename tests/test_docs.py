"""The docs stay true: every config key is documented, and the README's commands exist."""

from __future__ import annotations

from pathlib import Path

from kvdepot.cli import build_parser
from kvdepot.config import config_keys

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_key_is_documented() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f.name for f in config_keys() if f"`{f.name}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_readme_setup_commands_are_the_ci_ones() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = readme[readme.index("## Set-up"):]
    first = next(line for line in setup.splitlines() if line.startswith("python3 -m venv"))
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && ")  # a venv first
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in first  # CPU torch, explicit
    assert first.endswith("pip install -r requirements-cpu.txt && kvdepot demo")
    assert "torch==2.13.0" in (ROOT / "requirements-cpu.txt").read_text() and 'TORCH="torch==2.13.0+cpu"' in ci
    assert "python3 -m pytest -q" in readme and "python3 -m pytest -q" in ci
    assert "python3 -m build" in ci and "bin/kvdepot demo" in ci  # the wheel, installed and run


def test_cli_subcommands_parse() -> None:
    parser = build_parser()
    for argv in (["demo", "--help"], ["config"], ["config", "--check"], ["bench", "transfer"], ["bench", "lookup"],
                 ["bench", "ttft"], ["bench", "tiers"], ["bench", "mp"], ["bench", "vllm"], ["bench", "bookkeeping"],
                 ["stats"], ["stats", "--watch", "2"]):
        if "--help" in argv:
            continue
        assert parser.parse_args(argv).func is not None
