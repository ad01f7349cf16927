"""The ``kvdepot`` command: demo, config, bench, server, stats.

Nothing here allocates device memory until a subcommand runs; errors kvdepot raises on
purpose (bad config, bad input) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvdepot.config import config_keys, resolve_config
from kvdepot.errors import KVDepotError

BENCHES = {
    "transfer": ("kvdepot.bench.transfer", "store/retrieve GB/s of whole blocks vs pinned memcpy, same run"),
    "lookup": ("kvdepot.bench.lookup", "time to key and look up a long prompt (CPU)"),
    "ttft": ("kvdepot.bench.ttft", "TTFT of recompute vs a kvdepot hit in the reference runtime, and miss overhead"),
    "tiers": ("kvdepot.bench.tiers", "disk and Redis tiers vs raw I/O of the same bytes, and TTFT of hits served from each tier"),
    "mp": ("kvdepot.bench.mp", "server store/retrieve GB/s vs in-process and pinned memcpy; LOOKUP round trip"),
    "soak": ("kvdepot.bench.soak", "client processes under server/client/Redis kills and SIGSTOP; every loaded byte checked"),
}


def _cmd_config(args: argparse.Namespace) -> int:
    config, sources = resolve_config()
    fields = config_keys()
    width = max(len(f.name) for f in fields)
    vwidth = max(len(repr(getattr(config, f.name))) for f in fields)
    for f in fields:
        value = repr(getattr(config, f.name))
        if f.metadata["secret"] and getattr(config, f.name) is not None:
            value = "'***'"
        print(f"{f.name.ljust(width)}  {value.ljust(vwidth)}  [{sources[f.name]}]  {f.metadata['doc']}" if args.verbose
              else f"{f.name.ljust(width)}  {value.ljust(vwidth)}  [{sources[f.name]}]")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.bench][0])
    module.run(args)
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvdepot.config import load_config
    from kvdepot.server.stats_cmd import print_stats

    return print_stats(args.url or load_config().server_url)


def _cmd_keys(args: argparse.Namespace) -> int:
    from kvdepot.server.auth import write_keys

    for path in write_keys(args.dir):
        print(path)
    print(f"server: --server-curve-dir {args.dir} (reads server.key_secret, authorized_clients/); clients: "
          f"KVDEPOT_SERVER_CURVE_DIR={args.dir} (read server.key, client.key_secret)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvdepot.demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdepot",
        description="kvdepot — a KV-cache layer for LLM inference engines (TensorRT-LLM first). "
        "Configuration comes from defaults < $KVDEPOT_CONFIG_FILE (YAML) < KVDEPOT_<KEY> env vars.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run a long prompt twice through the reference runtime: miss, then a kvdepot hit")
    from kvdepot.demo import add_arguments as demo_args

    demo_args(demo)
    demo.set_defaults(func=_cmd_demo)

    sub.add_parser("server", help="run the multi-process cache server (see: kvdepot server --help)", add_help=False)
    stats = sub.add_parser("stats", help="print a running server's live figures")
    stats.add_argument("--url", default=None, help="server URL (default: KVDEPOT_SERVER_URL or the per-user ipc:// socket)")
    stats.set_defaults(func=_cmd_stats)

    keys = sub.add_parser("keys", help="write CURVE key pairs for a tcp:// server and its clients (docs/server.md)")
    keys.add_argument("dir", help="directory to create (0700); becomes server_curve_dir")
    keys.set_defaults(func=_cmd_keys)

    cfg = sub.add_parser("config", help="print the effective config and where each value came from")
    cfg.add_argument("-v", "--verbose", action="store_true", help="also print each key's documentation")
    cfg.set_defaults(func=_cmd_config)

    bench = sub.add_parser("bench", help="benchmarks that print measured figures next to a ceiling measured in the same run")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (module_name, text) in BENCHES.items():
        p = benches.add_parser(name, help=text)
        importlib.import_module(module_name).add_arguments(p)
        p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["server"]:  # the server has its own parser: `kvdepot server --help` shows it
        from kvdepot.server.__main__ import main as server_main

        return server_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVDepotError as exc:
        print(f"kvdepot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
