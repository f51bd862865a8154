"""``tiercache cache ...``: cache control on the node server (pin, unpin, prefetch, delete, stats) and
:func:`control`, the same for programs (one ``CONTROL`` request on an admin connection).

Objects are named by key (``--key``, repeatable), by key prefix (``--prefix``: a keyspace's prefix names
everything one model stored) or by tenant (``--salt``: the ``cache_salt`` the tenant's requests carry, with
``--lora``: the LoRA adapter's name where ``l1.tenant_by = "salt+lora"``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["add_cache_command", "control"]

_ACTIONS = {
    "pin": "load the objects into L1 from L2 where needed and keep them there (bounded per tenant)",
    "unpin": "let pinned objects be evicted again",
    "prefetch": "load the objects from L2 into L1 ahead of their requests",
    "delete": "delete the objects from L1 and every L2 tier that deletes (--all: everything)",
    "stats": "objects, bytes and pins per tenant in the server's L1",
}


def control(
    socket_path: str,
    action: str,
    *,
    keys: Sequence[str] = (),
    prefix: str | None = None,
    tenant: str | None = None,
    wait_s: float = 10.0,
    server_uid: int | None = None,
) -> dict[str, Any]:
    """Run one cache-control ``action`` on the server at ``socket_path`` (an admin connection: the server's
    own uid or its admin group); its answer. ``ServerUnavailable`` / ``ServerRefused`` when it cannot."""
    from tiercache.server.client import ServerConnection
    from tiercache.server.protocol import MAX_KEYS, Op

    conn = ServerConnection(socket_path, role="admin", server_uid=server_uid)
    try:
        body: dict[str, Any] = {"action": action, "prefix": prefix, "tenant": tenant, "wait_s": wait_s}
        if not keys:
            return conn.request(Op.CONTROL, {**body, "keys": []}, wait_s=wait_s)
        total: dict[str, Any] = {}
        for start in range(0, len(keys), MAX_KEYS):
            part = {**body, "keys": list(keys[start : start + MAX_KEYS])}
            if start:
                part.update(prefix=None, tenant=None)  # the prefix's keys once
            for name, value in conn.request(Op.CONTROL, part, wait_s=wait_s).items():
                total[name] = total.get(name, 0) + value if isinstance(value, int) else value
        return total
    finally:
        conn.close()


def _cmd_cache(args: argparse.Namespace) -> int:
    from tiercache.config import load_config
    from tiercache.store.policy.quotas import tenant_id

    socket_path = args.socket
    if socket_path is None and args.config:
        socket_path = load_config(args.config).server.socket
    if not socket_path:
        raise ValueError("no server socket: pass --socket or --config with server.socket")
    lora = getattr(args, "lora", None)
    tenant = tenant_id(args.salt or "", lora or "") if args.salt is not None or lora else None
    prefix = "" if getattr(args, "all", False) else args.prefix
    if args.action not in ("stats",) and not (args.key or prefix is not None or tenant is not None):
        raise ValueError(f"cache {args.action}: name the objects with --key, --prefix or --salt")
    answer = control(socket_path, args.action, keys=args.key, prefix=prefix, tenant=tenant, wait_s=args.wait)
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
    elif args.action == "stats":
        print(f"{'tenant':<20} {'objects':>8} {'bytes':>14} {'pinned':>7}")
        for name, row in sorted(answer.get("tenants", {}).items()):
            print(f"{name or '(none)':<20} {row['objects']:>8} {row['bytes']:>14} {row['pinned']:>7}")
        print(f"{'keyspace prefix':<40} {'objects':>8}")
        for prefix, count in sorted(answer.get("keyspaces", {}).items()):
            print(f"{prefix or '(other keys)':<40} {count:>8}")
        print(f"pinned on request: {answer.get('pins', 0)}")
    else:
        print(" ".join(f"{k}={v}" for k, v in sorted(answer.items())))
    return 0


def add_cache_command(sub: Any) -> None:
    """Register ``cache`` and its actions on the CLI's subparsers."""
    p = sub.add_parser("cache", help="cache control on the node server: pin, unpin, prefetch, delete, stats")
    actions = p.add_subparsers(dest="action", required=True)
    for action, text in _ACTIONS.items():
        a = actions.add_parser(action, help=text)
        a.add_argument("--socket", help="the server's Unix socket (default: server.socket of --config)")
        a.add_argument("--config", help="config file naming server.socket")
        a.add_argument("--json", action="store_true", help="print the answer as JSON")
        a.add_argument("--wait", type=float, default=10.0, help="seconds a pin or prefetch may load (10)")
        if action != "stats":
            a.add_argument("--key", action="append", default=[], help="an object key (repeat)")
            a.add_argument("--prefix", help="every object whose key starts with this")
            a.add_argument("--salt", help="every object of the tenant whose requests carry this cache_salt")
            a.add_argument(
                "--lora", help='with l1.tenant_by = "salt+lora": the tenant of this LoRA adapter (and --salt)'
            )
        else:
            a.set_defaults(key=[], prefix=None, salt=None, lora=None)
        if action == "delete":
            a.add_argument("--all", action="store_true", help="every object (L1, and L2 as far as known)")
        a.set_defaults(func=_cmd_cache)
