"""The ``kvdepot`` command as a user meets it: fast help that imports no torch, ``--version``, one
line and status 2 for a bad config on every command, ``config --check``, ``stats --watch``, and
the application's logger level left alone."""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvdepot.cli import BENCHES, main

ROOT = Path(__file__).resolve().parents[1]


def imports_after(argv: list[str]) -> set[str]:
    """Modules a fresh interpreter has imported after running ``kvdepot ARGV`` (help exits)."""
    code = ("import sys\nfrom kvdepot.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('MODULES', ' '.join(sorted(sys.modules)))")
    import kvdepot

    env = {**os.environ, "PYTHONPATH": str(Path(kvdepot.__file__).resolve().parents[1])}  # the code under test
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60).stdout
    return set(out.rsplit("MODULES ", 1)[1].split())


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["bench", "--help"], ["stats", "--help"], ["demo", "--help"],
                                  ["config", "--help"]])
def test_help_imports_no_torch(argv: list[str]) -> None:
    modules = imports_after(argv)
    assert "kvdepot.cli" in modules  # it did run
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "numpy", "zmq", "redis", "transformers", "vllm")}
    assert not heavy, f"kvdepot {' '.join(argv)} imported {sorted(heavy)[:5]}"
    assert not {m for m in modules if m.startswith("kvdepot.bench.")}


def test_bench_help_builds_only_the_named_bench() -> None:
    modules = imports_after(["bench", "lookup", "--help"])
    assert "kvdepot.bench.lookup" in modules and "kvdepot.bench.ttft" not in modules


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    from kvdepot import __version__

    assert capsys.readouterr().out.strip() == f"kvdepot {__version__}"


BAD_CONFIGS = {
    "unknown env key": ({"KVDEPOT_FOO": "1"}, None, "KVDEPOT_FOO"),
    "bad env value": ({"KVDEPOT_CHUNK_SIZE": "many"}, None, "chunk_size"),
    "bad yaml": ({}, "chunk_size: [1,\n", "not valid YAML"),
    "unknown file key": ({}, "chunk_sise: 64\n", "chunk_sise"),
    "wrong file type": ({}, "host_capacity_gb: lots\n", "host_capacity_gb"),
}
COMMANDS = [["--help"], ["demo"], ["demo", "--help"], ["config"], ["config", "--check"], ["stats"], ["stats", "--watch"],
            ["bench", "--help"], ["bench", "lookup", "--help"], ["server"], ["server", "--help"]]


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_config_is_one_line_and_status_2_for_every_command(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    env, text, needle = BAD_CONFIGS[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if text is not None:
        (tmp_path / "kvdepot.yaml").write_text(text)
        monkeypatch.setenv("KVDEPOT_CONFIG_FILE", str(tmp_path / "kvdepot.yaml"))
    for argv in COMMANDS:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "", argv
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvdepot: error:") and needle in lines[0], (argv, captured.err)


def test_every_bench_has_help_on_every_option() -> None:
    import argparse

    from kvdepot.cli import build_parser

    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    assert set(bench.choices) == set(BENCHES)
    for name, sub in bench.choices.items():
        options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
        assert options, name
        undocumented = [a.option_strings[0] for a in options if not a.help]
        assert not undocumented, f"bench {name}: options without help: {undocumented}"
        if name not in ("ttft",):  # ttft writes its own line plot and JSON
            assert {"--json", "--plot"} <= {s for a in options for s in a.option_strings}, name


def check_lines(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 4  # disk_path, remote_url, server_url, metrics_port: one line each
    return {line.split()[1]: line for line in out}


def test_config_check_passes_on_a_usable_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], redis_server) -> None:
    monkeypatch.setenv("KVDEPOT_DISK_PATH", str(tmp_path / "disk"))
    monkeypatch.setenv("KVDEPOT_DISK_CAPACITY_GB", "0.001")
    monkeypatch.setenv("KVDEPOT_REMOTE_URL", redis_server.url)
    monkeypatch.setenv("KVDEPOT_SERVER_URL", f"ipc://{tmp_path}/s.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("KVDEPOT_METRICS_PORT", str(s.getsockname()[1]))
    assert main(["config", "--check"]) == 0
    lines = check_lines(capsys)
    assert all(line.startswith("ok") for line in lines.values()), lines
    assert "PING answered" in lines["remote_url"] and "will be created" in lines["disk_path"]
    assert "no server answers" in lines["server_url"]
    assert not (tmp_path / "disk").exists() and not list(tmp_path.glob(".kvdepot-check-*"))  # nothing left behind


def test_config_check_fails_naming_each_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        monkeypatch.setenv("KVDEPOT_DISK_PATH", str(blocker))
        monkeypatch.setenv("KVDEPOT_REMOTE_URL", f"redis://127.0.0.1:{dead}/0")
        monkeypatch.setenv("KVDEPOT_METRICS_PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("KVDEPOT_SERVER_URL", f"ipc://{tmp_path}/nodir/s.sock")
        assert main(["config", "--check"]) == 1
    finally:
        taken.close()
    lines = check_lines(capsys)
    assert lines["disk_path"].startswith("FAIL") and "not a directory" in lines["disk_path"]
    assert lines["remote_url"].startswith("FAIL") and str(dead) in lines["remote_url"]
    assert lines["metrics_port"].startswith("FAIL")
    assert lines["server_url"].startswith("FAIL") and "not writable" in lines["server_url"]


def test_config_check_finds_a_running_server(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdepot.config import load_config
    from kvdepot.server.server import DepotServer

    sys.path.insert(0, str(ROOT / "tests" / "server"))
    from mp_helpers import short_dir

    work = short_dir()
    try:
        with DepotServer(f"ipc://{work}/s.sock", load_config(host_capacity_gb=0.01)) as server:
            monkeypatch.setenv("KVDEPOT_SERVER_URL", server.url)
            assert main(["config", "--check"]) == 0
            assert "a kvdepot server answers" in check_lines(capsys)["server_url"]
            from kvdepot.server.watch import watch

            out = io.StringIO()
            assert watch(server.url, interval_s=0.1, out=out, frames=2) == 0
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    frames = out.getvalue().split("\x1b[H\x1b[2J")[1:]
    assert len(frames) == 2 and all("kvdepot stats --watch" in f and server.url in f for f in frames)


def test_watch_renders_rates_from_two_snapshots() -> None:
    from kvdepot.server import protocol as p
    from kvdepot.server.watch import render

    def snap(hits: float, misses: float, stored: float) -> p.StatsReply:
        figures = {"hits": hits, "misses": misses, "lookups": hits, "bytes_stored": stored, "host_chunks": 3.0,
                   "host_capacity_chunks": 8.0}
        return p.StatsReply(1, 42, "ipc:///s", 10.0, 2, 1, 0, [p.ShardStats("llama", 0, figures)])

    frame = render(snap(30, 10, 4e9), snap(10, 0, 2e9), 2.0)
    row = frame.splitlines()[-1].split()
    assert row[:2] == ["llama", "0"]
    assert row[2] == "10.000" and row[3] == "5.000"  # hits/s, misses/s over the 2 s interval
    assert row[5] == "1.000" and row[-1] == "67%"  # store GB/s; 20 of 30 looked up in the interval hit
    assert "rates over the last interval" in frame and "pid 42" in frame


def test_no_server_to_watch_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["stats", "--watch", "--url", f"ipc://{tmp_path}/none.sock"]) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0


@pytest.mark.parametrize("level", [None, "DEBUG"])
def test_logger_level_is_the_applications_unless_log_level_is_set(level: str | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from kvdepot.integrations.tensorrt_llm.setup import depot_config

    logger = logging.getLogger("kvdepot")
    before = logger.level
    logger.setLevel(logging.ERROR)  # the application's choice
    try:
        if level:
            monkeypatch.setenv("KVDEPOT_LOG_LEVEL", level)
        depot_config(SimpleNamespace(model="m"))
        assert logger.level == (logging.DEBUG if level else logging.ERROR)
    finally:
        logger.setLevel(before)


def test_demo_refuses_a_prompt_shorter_than_a_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--prompt-tokens", "200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "shorter than one chunk" in err and "256" in err


def test_demo_explains_the_recomputed_tokens() -> None:
    from kvdepot.demo import expected_hit, explain_recompute

    assert expected_hit(2048, 256, 32) == 2016
    assert "last block (32 tokens" in explain_recompute(2048, 2016, 256, 32)
    assert expected_hit(2100, 256, 32) == 2048
    note = explain_recompute(2100, 2048, 256, 32)
    assert "52 tokens past the last whole 256-token chunk" in note
    assert explain_recompute(2048, 2048, 256, 32) == ""
