"""``kvdepot server --help`` covers every config key; the MP benchmark runs on CPU."""

from __future__ import annotations

import argparse

import pytest

from kvdepot.config import config_keys
from kvdepot.server.__main__ import build_parser, main

pytestmark = pytest.mark.timeout(120)


def test_help_has_a_flag_for_every_config_key():
    text = build_parser().format_help()
    for field in config_keys():
        assert "--" + field.name.replace("_", "-") in text
    for flag in ("--url", "--tcp", "--session-timeout-s", "--metrics-port", "KVDEPOT_SERVER_URL", "Ctrl-C"):
        assert flag in text


def test_flags_override_config_and_bad_values_fail_clearly(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--hash-algo", "md5"])
    assert info.value.code == 2
    assert build_parser().parse_args(["--chunk-size", "64", "--save-decode-cache"]).save_decode_cache is True
    assert main(["--chunk-size", "0"]) == 2  # validated by the config table: a bad setting, status 2
    assert "chunk_size" in capsys.readouterr().err
    assert main(["--url", "http://x"]) == 2
    assert "expected ipc://PATH or tcp://HOST:PORT" in capsys.readouterr().err


def test_mp_benchmark_on_cpu():
    from kvdepot.bench.mp import run

    args = argparse.Namespace(device="cpu", layers=2, kv_heads=2, head_dim=64, tokens_per_block=16,
                              chunk_size=32, blocks=8, reps=2, lookups=50)
    rows = run(args)
    cases = {(r["mode"], r["op"]) for r in rows}
    assert {("memcpy", "store"), ("in-process", "retrieve"), ("multi-process", "store"),
            ("multi-process", "lookup rtt"), ("zmq echo", "ping rtt")} <= cases
    assert all(r["GB/s"] > 0 and r["ratio"] > 0 for r in rows if r["GB/s"] is not None)
    rtt = next(r for r in rows if r["op"] == "lookup rtt")
    assert 0 < rtt["p50 us"] <= rtt["p99 us"]
    floor, ping = (next(r for r in rows if r["op"] == "ping rtt" and r["mode"] == m) for m in ("zmq echo", "multi-process"))
    assert 0 < floor["p50 us"] <= floor["p99 us"]
    assert ping["ratio"] == pytest.approx(floor["p50 us"] / ping["p50 us"])
    multi = next(r for r in rows if r["mode"] == "multi-process" and r["op"] == "retrieve")
    assert multi["pool"] == "shm" and multi["vs in-process"] > 0


def test_zmq_echo_floor_returns_the_frames_and_leaves_nothing_behind():
    import glob

    import zmq

    from kvdepot.bench.zmq_echo import echo_rtt, echo_server

    before = set(glob.glob("/tmp/kvd-echo-*"))
    with echo_server() as url:
        figures = echo_rtt(url, [b"header", b"body"], 20)
        assert 0 < figures["p50 us"] <= figures["p99 us"]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(url)
        sock.send_multipart([b"a", b"b" * 1000])
        assert sock.recv_multipart() == [b"a", b"b" * 1000]  # echoed whole: the floor carries what a PING does
        sock.close(0)
        ctx.term()
    assert set(glob.glob("/tmp/kvd-echo-*")) == before  # the socket's directory is gone with the process


@pytest.mark.parametrize("argv, says", [([], "usage: python -m kvdepot.bench.zmq_echo URL"),
                                        (["http://nowhere"], "zmq_echo: cannot bind 'http://nowhere'")])
def test_zmq_echo_refuses_bad_arguments_in_one_line(argv, says):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvdepot.bench.zmq_echo", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(says) and done.stderr.count("\n") == 1
