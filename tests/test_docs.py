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
    assert "pip install -r requirements-cpu.txt && kvdepot demo" in readme
    assert "python3 -m pytest -q" in readme and "python3 -m pytest -q" in ci


def test_cli_subcommands_parse() -> None:
    parser = build_parser()
    for argv in (["demo", "--help"], ["config"], ["bench", "transfer"], ["bench", "lookup"], ["bench", "ttft"], ["bench", "tiers"], ["bench", "mp"], ["stats"]):
        if "--help" in argv:
            continue
        assert parser.parse_args(argv).func is not None
