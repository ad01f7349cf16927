"""``kvdepot server`` / ``python -m kvdepot.server``: run the multi-process cache server.

Every configuration key has a flag, generated from the config table (``config.config_keys()``),
so a new key shows up here by itself. Flags override ``KVDEPOT_*`` environment variables, which
override ``KVDEPOT_CONFIG_FILE``. Settings the server could not serve with are refused at start,
in one line with exit status 2 (``settings.check_settings``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvdepot.config import ENV_PREFIX, config_keys, resolve_config
from kvdepot.errors import ConfigError, KVDepotError
from kvdepot.server.paths import default_url, tcp_url
from kvdepot.server.server import DepotServer
from kvdepot.server.settings import check_settings

_DESCRIPTION = """\
Run kvdepot's cache server: it owns the host memory tier and serves every TensorRT-LLM
engine (and every tensor-parallel rank) that connects, so cached KV survives engine restarts
and is shared between engines on this machine.

Engines find the server through the KVDEPOT_SERVER_URL environment variable (TensorRT-LLM 1.2's
kv_connector_config has no server_url; main's may carry one), else the default below.
Use the multi-process connector:
  connector_module="kvdepot.integrations.tensorrt_llm.mp_adapter",
  connector_scheduler_class="KvDepotMPConnectorScheduler",
  connector_worker_class="KvDepotMPConnectorWorker"
"""

_EPILOG = """\
examples:
  kvdepot server                                  # per-user ipc:// socket, 4 GB host tier
  kvdepot server --host-capacity-gb 64 --metrics-port 9400
  kvdepot keys ~/.kvdepot-keys                    # once: CURVE keys for TCP (see docs/server.md)
  kvdepot server --tcp 5555 --server-curve-dir ~/.kvdepot-keys   # tcp://127.0.0.1:5555, CURVE
  kvdepot stats                                   # live figures of the running server
Stop it with Ctrl-C or SIGTERM: sessions are closed and the socket file is removed.
"""

_SERVER_KNOBS = {  # server settings that are not (yet) config keys: name -> (type, default, help)
    "session_timeout_s": (float, 30.0, "close a client's session (leases, mapped pool) after this many "
                                       "seconds without a message; clients PING every second"),
    "metrics_port": (int, 0, "serve Prometheus metrics on --metrics-host:PORT (0 = off)"),
    "workers": (int, 4, "handler threads (copies, lookups)"),
    "max_frame_mb": (int, 4096, "largest message frame accepted, in MiB (bigger ones drop the connection)"),
}


def _type_name(field: object) -> str:
    return str(getattr(field, "type", "str")).replace(" | None", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdepot server", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("where to listen")
    where.add_argument("--url", help=f"ipc://PATH or tcp://HOST:PORT (default: {_default_url_text()})")
    where.add_argument("--tcp", type=int, metavar="PORT",
                       help="listen on tcp://127.0.0.1:PORT (loopback); for another address use --url")
    where.add_argument("--insecure", action="store_true",
                       help="allow tcp:// without CURVE keys (server_curve_dir): anyone who can connect reads and writes KV")
    server = parser.add_argument_group("server")
    keys = {f.name for f in config_keys()}
    for name, (kind, default, text) in _SERVER_KNOBS.items():
        if name not in keys:
            server.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"{text} (default: {default})")
    cache = parser.add_argument_group("cache settings (config keys; a flag overrides the KVDEPOT_<KEY> "
                                      "environment variable and KVDEPOT_CONFIG_FILE)")
    for f in config_keys():
        flag = "--" + f.name.replace("_", "-")
        doc = f"{f.metadata.get('doc', '')} (default: {f.default!r}; env {ENV_PREFIX}{f.name.upper()})"
        kind = _type_name(f)
        if kind == "bool":
            cache.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=doc)
            continue
        convert = {"int": int, "float": float}.get(kind, str)
        choices = f.metadata.get("choices") or None
        cache.add_argument(flag, dest=f.name, type=convert, choices=choices, default=argparse.SUPPRESS, help=doc)
    return parser


def _default_url_text() -> str:
    try:
        return default_url()
    except KVDepotError as exc:
        return f"unavailable: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in config_keys() if hasattr(args, f.name)}
    try:
        config, _sources = resolve_config(overrides)
        if args.url and args.tcp:
            raise KVDepotError("give --url or --tcp, not both")
        url = args.url or (tcp_url(args.tcp) if args.tcp else None) or config.server_url or default_url()
        knobs = {name: _knob(args, config, name) for name in _SERVER_KNOBS}
        check_settings(config)  # an unusable disk_path, chunk_size or remote_url: refused now, not per REGISTER
        level = config.log_level or "INFO"  # the server is the application: its own default
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("kvdepot").setLevel(level)
        server = DepotServer(url, config, workers=int(knobs["workers"]), session_timeout_s=float(knobs["session_timeout_s"]),
                             max_frame_bytes=int(knobs["max_frame_mb"]) << 20, metrics_port=int(knobs["metrics_port"]), insecure=args.insecure)
        server.serve_forever(ready=lambda: print(
            f"kvdepot server listening on {server.url} (pid {os.getpid()}); engines connect with "
            f"KVDEPOT_SERVER_URL={server.url}; Ctrl-C stops it", file=sys.stderr, flush=True))
    except ConfigError as exc:  # the operator's settings: one line, status 2 (as for bad arguments)
        print(f"kvdepot server: {exc}", file=sys.stderr)
        return 2
    except KVDepotError as exc:
        print(f"kvdepot server: {exc}", file=sys.stderr)
        return 1
    return 0


def _knob(args: argparse.Namespace, config: object, name: str) -> object:
    value = getattr(args, name, None)
    if value is None:
        value = getattr(config, name, _SERVER_KNOBS[name][1])
    return value


if __name__ == "__main__":
    sys.exit(main())
