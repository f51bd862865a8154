"""``tiercache serve``: the subcommand's flags and handler (registered by the main CLI with one call)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tiercache.config import LOG_LEVELS

__all__ = ["add_health_command", "add_serve_command", "serve"]


def add_serve_command(sub: Any) -> None:
    """Register ``serve`` on the CLI's subparsers (``sub`` is argparse's subparsers action)."""
    p = sub.add_parser("serve", help="run the node's shared-L1 server on a Unix socket (server mode)")
    p.add_argument(
        "--config",
        help="config file: l1.capacity, the [server] table and the L2 [[tiers]] the server runs "
        "(default: an L1 of 1 GiB, no L2 tier)",
    )
    p.add_argument("--socket", help="Unix socket path (wins over server.socket)")
    p.add_argument(
        "--slot-bytes",
        type=int,
        help="an object size to make a size class for at start (wins over server.slot_bytes; optional: "
        "classes come from the clients' object sizes)",
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        help="lowest level logged to stderr, one line per record (wins over server.log_level; default info)",
    )
    p.set_defaults(func=_cmd_serve)


def serve(argv: Sequence[str]) -> int:
    """``tiercache serve ARGV`` without the rest of the command line (the autostart keeper's server): parse
    the flags, serve, return the exit status."""
    parser = argparse.ArgumentParser(prog="tiercache")
    add_serve_command(parser.add_subparsers())
    return _cmd_serve(parser.parse_args(["serve", *argv]))


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 and one line on stderr for a bad or unreadable config or another live
    server on the socket."""
    import sys

    from tiercache.config import Config, load_config
    from tiercache.errors import ConfigError
    from tiercache.server.logsetup import setup_server_logging
    from tiercache.server.main import options_from_config, run_server

    try:
        config = load_config(args.config) if args.config else Config()
    except ConfigError as exc:
        print(f"tiercache: error: {exc}", file=sys.stderr)
        return 2
    socket_path = args.socket or config.server.socket
    if not socket_path:
        print("tiercache serve: no socket: pass --socket or set server.socket", file=sys.stderr)
        return 2
    try:
        options = options_from_config(config, socket_path, args.slot_bytes)
    except ValueError as exc:
        print(f"tiercache serve: {args.config or 'no config'}: {exc}", file=sys.stderr)
        return 2
    srv = config.server
    setup_server_logging(args.log_level or srv.log_level)
    metrics = None if srv.metrics_port is None else (srv.metrics_host, srv.metrics_port)
    return run_server(options, metrics=metrics, config=config)


def add_health_command(sub: Any) -> None:
    """Register ``health`` (probe a running server through its socket) on the CLI's subparsers."""
    p = sub.add_parser(
        "health",
        help="probe a running server through its socket: exit 0 healthy, 1 not, 2 usage/config error",
        description="Connect as a probe (HELLO role probe, no segment mapped), ask for STATS, and print one "
        "line. Exit 0 when the server answered both within the timeout, 1 otherwise, 2 on a usage or "
        "config error. For systemd ExecStartPost/watchdog scripts and Kubernetes exec probes.",
    )
    p.add_argument("socket", nargs="?", help="Unix socket path (wins over server.socket of --config)")
    p.add_argument("--config", help="config file whose server.socket to probe")
    p.add_argument(
        "--timeout", type=float, default=5.0, help="seconds for the whole probe, HELLO and STATS (default 5)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (with the server's STATS)")

    def _cmd_health(args: argparse.Namespace) -> int:
        from tiercache.server.health import run_health

        return run_health(args)

    p.set_defaults(func=_cmd_health)
