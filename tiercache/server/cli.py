"""``tiercache serve``: the subcommand's flags and handler (registered by the main CLI with one call)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_serve_command"]


def add_serve_command(sub: Any) -> None:
    """Register ``serve`` on the CLI's subparsers (``sub`` is argparse's subparsers action)."""
    p = sub.add_parser("serve", help="run the node's shared-L1 server on a Unix socket (server mode)")
    p.add_argument(
        "--config",
        help="config file: l1.capacity, the [server] table and the L2 [[tiers]] the server runs "
        "(default: an L1 of 1 GiB, no L2 tier)",
    )
    p.add_argument("--socket", help="Unix socket path (wins over server.socket)")
    p.add_argument("--slot-bytes", type=int, help="bytes of one L1 slot (wins over server.slot_bytes)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 on a config error or another live server on the socket."""
    import grp
    import sys

    from tiercache.config import Config, load_config
    from tiercache.server.main import run_server
    from tiercache.server.segment import SlotClass
    from tiercache.server.server import ServerOptions

    config = load_config(args.config) if args.config else Config()
    srv = config.server
    socket_path = args.socket or srv.socket
    slot_bytes = args.slot_bytes or srv.slot_bytes
    if not socket_path:
        print("tiercache serve: no socket: pass --socket or set server.socket", file=sys.stderr)
        return 2
    if not slot_bytes or slot_bytes < 0:
        print(
            f"tiercache serve: {args.config or 'no config'}: set server.slot_bytes or --slot-bytes "
            "(bytes of one KV chunk)",
            file=sys.stderr,
        )
        return 2
    slot = SlotClass(slot_bytes, 1)
    count = config.l1.capacity // slot.stride
    if count <= 0:
        print(f"tiercache serve: l1.capacity holds no slot of {slot_bytes} bytes", file=sys.stderr)
        return 2
    group = grp.getgrnam(srv.group).gr_gid if isinstance(srv.group, str) else srv.group
    options = ServerOptions(
        socket_path=socket_path,
        slot_classes=[SlotClass(slot_bytes, count)],
        mode=srv.mode,
        group=group,
        allowed_uids=frozenset(srv.allowed_uids),
        drain_s=srv.drain_s,
    )
    metrics = None if srv.metrics_port is None else (srv.metrics_host, srv.metrics_port)
    return run_server(options, metrics=metrics, config=config)
