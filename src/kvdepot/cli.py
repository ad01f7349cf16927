"""The ``kvdepot`` command: demo, config, bench, server, stats.

Import-light by design: ``kvdepot --help`` and ``kvdepot --version`` import neither torch nor a
bench (torch alone took 2-6 s to import on the dev VM); a subcommand imports what it runs, and
``kvdepot bench NAME`` builds the options of that bench only. Errors kvdepot raises on purpose
(bad config, bad input) print one line and exit with status 2 — for every command, ``--help``
included, since a bad ``KVDEPOT_*`` variable or config file must not look like a crash.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvdepot.errors import KVDepotError

# name -> (module with add_arguments(parser) and run(args), one-line help)
BENCHES = {
    "transfer": ("kvdepot.bench.transfer", "store/retrieve GB/s of whole blocks vs pinned memcpy, same run"),
    "lookup": ("kvdepot.bench.lookup", "time to key and look up a long prompt (CPU)"),
    "ttft": ("kvdepot.bench.ttft", "TTFT of recompute vs a kvdepot hit in the reference runtime, and miss overhead"),
    "tiers": ("kvdepot.bench.tiers", "disk and Redis tiers vs raw I/O of the same bytes, and TTFT of hits served from each tier"),
    "mp": ("kvdepot.bench.mp", "server store/retrieve GB/s vs in-process and pinned memcpy; LOOKUP round trip"),
    "soak": ("kvdepot.bench.soak", "client processes under server/client/Redis kills and SIGSTOP; every loaded byte checked"),
    "vllm": ("kvdepot.bench.vllm", "TTFT of real vLLM without a connector, with kvdepot, and with vLLM's own prefix cache"),
    "hooks": ("kvdepot.bench.layer_hooks", "host time a load by layer costs the forward per layer hook: in-process vs server mode (LAYERS or progress page), simulated copies (CPU)"),
    "dma": ("kvdepot.bench.dma_ceiling", "the copy engines' and driver's ceiling for scattered blocks: batched copies listed beforehand vs pinned memcpy (CUDA)"),
    "contexts": ("kvdepot.bench.cross_context", "what another process's copies into this GPU cost a forward waiting on them, by the stream its events are recorded on (CUDA)"),
    "ab": ("kvdepot.bench.ab", "two source trees in one process: store/retrieve/both-at-once ratios paired round by round (a change's A/B on a host whose processes differ)"),
    "bookkeeping": ("kvdepot.bench.bookkeeping", "host-side cost of CacheEngine store/lookup/retrieve with no copy (CPU)"),
    "tp": ("kvdepot.bench.tp", "MLA under tensor parallel 2 in server mode: bytes stored per chunk and load time, one copy vs per rank"),
    "firsthit": ("kvdepot.bench.first_hit", "a process's first kvdepot hit vs its later ones, and vs its first device hit (whose toll)"),
    "events": ("kvdepot.bench.kv_events_cost", "caller-side cost of a KV-event sink call, events off vs on (CPU)"),
    "cluster": ("kvdepot.bench.cluster", "N nodes over one Redis Cluster: hit rate, TTFT, recompute; round-robin vs routed by KV events"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvdepot")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH=src)
        from kvdepot import __version__

        return __version__


def _cmd_config(args: argparse.Namespace) -> int:
    from kvdepot.config import config_keys, resolve_config

    if args.check:
        from kvdepot.checks import run_checks

        return run_checks(sys.stdout)
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

    url = args.url or load_config().server_url
    if args.watch is not None:
        from kvdepot.server.watch import watch

        return watch(url, interval_s=args.watch)
    from kvdepot.server.stats_cmd import print_stats

    return print_stats(url)


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


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the bench it names gets its options built (and imported)."""
    parser = argparse.ArgumentParser(
        prog="kvdepot",
        description="kvdepot — a KV-cache layer for LLM inference engines (TensorRT-LLM first). "
        "Configuration comes from defaults < $KVDEPOT_CONFIG_FILE (YAML) < KVDEPOT_<KEY> env vars.",
    )
    parser.add_argument("--version", action="version", version=f"kvdepot {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from kvdepot.demo import add_arguments as demo_args

    demo = sub.add_parser("demo", help="run a long prompt twice through the reference runtime: miss, then a kvdepot hit")
    demo_args(demo)
    demo.set_defaults(func=_cmd_demo)

    sub.add_parser("server", help="run the multi-process cache server (see: kvdepot server --help)", add_help=False)
    stats = sub.add_parser("stats", help="print a running server's live figures (--watch: a live view)")
    stats.add_argument("--url", default=None, help="server URL (default: KVDEPOT_SERVER_URL or the per-user ipc:// socket)")
    stats.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                       help="redraw every SECONDS (default 1) with per-second rates, until Ctrl-C")
    stats.set_defaults(func=_cmd_stats)

    keys = sub.add_parser("keys", help="write CURVE key pairs for a tcp:// server and its clients (docs/server.md)")
    keys.add_argument("dir", help="directory to create (0700); becomes server_curve_dir")
    keys.set_defaults(func=_cmd_keys)

    cfg = sub.add_parser("config", help="print the effective config and where each value came from (--check: probe it)")
    cfg.add_argument("-v", "--verbose", action="store_true", help="also print each key's documentation")
    cfg.add_argument("--check", action="store_true", help="probe disk_path, remote_url, the server socket and the "
                     "metrics port: one line per check, exit status 1 if any fails")
    cfg.set_defaults(func=_cmd_config)

    bench = sub.add_parser("bench", help="benchmarks that print measured figures next to a ceiling measured in the same run")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    chosen = _named_bench(argv)
    for name, (module_name, text) in BENCHES.items():
        if argv is None or name == chosen:  # its module's docstring is its --help description
            module = importlib.import_module(module_name)
            p = benches.add_parser(name, help=text, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
            module.add_arguments(p)
        else:
            p = benches.add_parser(name, help=text, description=text)
        p.set_defaults(func=_cmd_bench)
    return parser


def _named_bench(argv: Sequence[str] | None) -> str | None:
    args = [a for a in (argv or []) if not a.startswith("-")]
    return args[1] if len(args) > 1 and args[0] == "bench" else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] != ["--version"]:
            from kvdepot.config import load_config

            load_config()  # a bad config fails here, in one line, before any help or work
        if argv[:1] == ["server"]:  # the server has its own parser: `kvdepot server --help` shows it
            from kvdepot.server.__main__ import main as server_main

            return server_main(argv[1:])
        args = build_parser(argv).parse_args(argv)
        return int(args.func(args) or 0)
    except KVDepotError as exc:
        print(f"kvdepot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
