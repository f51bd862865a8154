"""``tiercache cache ...``: cache control on the node server (pin, unpin, prefetch, delete, stats) and
:func:`control`, the same for programs (one ``CONTROL`` request on an admin connection).

Objects are named by key (``--key``, repeatable), by key prefix (``--prefix``: a keyspace's prefix names
everything one model stored) or by tenant (``--salt``: the ``cache_salt`` the tenant's requests carry, with
``--lora``: the LoRA adapter's name where ``l1.tenant_by = "salt+lora"``) or by prompt (``--prompt``: a JSON
list of token ids, keyed with the keyspace file the vLLM instance writes; see :mod:`tiercache.prompt_keys`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["add_cache_command", "control", "read_prompt"]

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
    keys = list(args.key)
    if getattr(args, "prompt", None):  # --salt and --lora are the prompt's, not a tenant to select
        keys += _prompt_keys(args)
        tenant = None
    else:
        tenant = tenant_id(args.salt or "", lora or "") if args.salt is not None or lora else None
    prefix = "" if getattr(args, "all", False) else args.prefix
    if args.action not in ("stats",) and not (keys or prefix is not None or tenant is not None):
        raise ValueError(
            f"cache {args.action}: name the objects with --key, --prefix or --salt (or --prompt)"
        )
    answer = control(socket_path, args.action, keys=keys, prefix=prefix, tenant=tenant, wait_s=args.wait)
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


def read_prompt(path: str) -> list[int]:
    """The token ids in the JSON file at ``path`` (a list of non-negative integers); ``ValueError`` naming
    the file when it holds anything else."""
    try:
        with open(path) as f:
            tokens = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--prompt {path}: cannot read a JSON list of token ids ({exc})") from None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise ValueError(f"--prompt {path}: not a JSON list of non-negative integer token ids")
    return tokens


def _prompt_keys(args: argparse.Namespace) -> list[str]:
    """The keys of ``--prompt``'s chunks in the instance described by ``--keyspace``."""
    from tiercache.prompt_keys import load_description, prompt_keys

    if not args.keyspace:
        raise ValueError("--prompt needs --keyspace: the keyspace file the vLLM instance writes")
    return prompt_keys(
        load_description(args.keyspace),
        read_prompt(args.prompt),
        cache_salt=args.salt or "",
        lora_name=args.lora or "",
        lora_path=args.lora_path or "",
    )


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
            a.add_argument(
                "--prompt",
                help="a JSON file of token ids: the objects of that prompt's chunks (with --keyspace; --salt "
                "and --lora are then the request's cache_salt and LoRA adapter name)",
            )
            a.add_argument("--keyspace", help="the keyspace file of the vLLM instance (its keyspace_file)")
            a.add_argument("--lora-path", help="with --prompt and --lora: the LoRA adapter's path")
        else:
            a.set_defaults(key=[], prefix=None, salt=None, lora=None)
        if action == "delete":
            a.add_argument("--all", action="store_true", help="every object (L1, and L2 as far as known)")
        a.set_defaults(func=_cmd_cache)
