"""Run one :class:`L1Server` until SIGTERM/SIGINT: ``python -m tiercache.server`` and ``tiercache serve``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiercache.config import LOG_LEVELS
from tiercache.server.logsetup import setup_server_logging
from tiercache.server.segment import stride_of
from tiercache.server.server import L1Server, ServerAlreadyRunning, ServerOptions
from tiercache.server.slots import Caps

if TYPE_CHECKING:
    from tiercache.config import Config

log = logging.getLogger(__name__)

__all__ = ["main", "options_from_config", "raise_fd_limit", "run_server", "server_uid_of"]


def _gid(group: int | str | None) -> int | None:
    """A group given by gid or name as a gid; ValueError naming an unknown group."""
    if group is None or isinstance(group, int):
        return group
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r}") from None


def server_uid_of(user: int | str | None) -> int | None:
    """``server.server_uid`` as a uid (a user name is looked up); ValueError naming an unknown user."""
    if user is None or isinstance(user, int):
        return user
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ValueError(f"no user named {user!r}") from None


def options_from_config(config: Config, socket_path: str, slot_bytes: int | None = None) -> ServerOptions:
    """The server options of ``config`` on ``socket_path`` (``slot_bytes`` wins over server.slot_bytes);
    ValueError with a one-line reason when they cannot serve."""
    srv = config.server
    declared = slot_bytes or srv.slot_bytes
    if declared is not None and declared <= 0:
        raise ValueError(f"slot bytes must be positive, got {declared}")
    options = ServerOptions(
        socket_path=socket_path,
        capacity=config.l1.capacity,
        slot_bytes=() if declared is None else (declared,),
        region_bytes=srv.region_bytes,
        mode=srv.mode,
        group=_gid(srv.group),
        allowed_uids=frozenset(srv.allowed_uids),
        admin_group=_gid(srv.admin_group),
        drain_s=srv.drain_s,
        caps=Caps(
            srv.max_leases_per_client,
            srv.max_share_per_client,
            max_pinned_share=config.l1.max_pinned_share,
            quotas=config.l1.quotas,
            default_quota=config.l1.default_quota,
        ),
        max_clients=srv.max_clients,
        orphan_grace_s=srv.orphan_grace_s,
        events_endpoint=srv.events_endpoint,
        events_topic=srv.events_topic,
    )
    geometry = options.geometry()
    if declared is not None and stride_of(declared) > geometry.region_bytes:
        raise ValueError(
            f"an object of {declared} bytes does not fit a region of {geometry.region_bytes} bytes "
            "(raise l1.capacity or server.region_bytes)"
        )
    return options


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft open-file limit to its hard limit (a daemon holds a socket and a pidfd per
    client); the (soft, hard) limits now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


def _say(line: str) -> None:
    """Print a status line; a closed stdout (the starter went away) never stops the server or its stop."""
    try:
        print(line, flush=True)
    except OSError:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  # later prints and the exit flush go nowhere


async def _run(options: ServerOptions, metrics: tuple[str, int] | None, config: Config | None) -> None:
    tiers = []
    if config is not None and config.tiers:
        from tiercache.store.manager import open_tiers

        tiers = await open_tiers(
            config
        )  # a tier down now is kept as a down tier, re-opened in the background
    soft, _ = raise_fd_limit()
    if soft < 4 * options.max_clients:
        log.warning(
            "the open-file limit (%d) is below 4 x max_clients (%d); raise LimitNOFILE / ulimit -n",
            soft,
            options.max_clients,
        )
    try:
        server = L1Server(
            options,
            tiers=tiers,
            policy=None if config is None else config.manager,
            tier_configs=() if config is None else config.tiers,
        )
        await server.start()
    except BaseException:
        for _, adapter, _ in tiers:
            await adapter.aclose()
        raise
    if metrics is not None:
        from tiercache.server.metrics import serve_metrics

        port = serve_metrics(server, *metrics)
        _say(f"tiercache server metrics on http://{metrics[0]}:{port}/metrics")
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        if stopping:
            return  # already stopping (draining): a second signal changes nothing
        pending = 0 if server.storage is None else server.storage.pending_stores()
        stopping.append(loop.create_task(server.stop()))
        _say(f"tiercache server stopping; draining {pending} pending L2 stores")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    _say(f"tiercache server listening on {options.socket_path} epoch {server.epoch}")
    try:
        await server.serve_forever()
    finally:
        await server.stop()


def run_server(
    options: ServerOptions, *, metrics: tuple[str, int] | None = None, config: Config | None = None
) -> int:
    """Serve until a stop signal (``metrics``: (host, port) of ``/metrics``; ``config``: its L2 tiers and
    manager policy run in the server); 0 on a clean stop, 2 when another server holds the socket path.
    Prints the metrics line first, then the ready line."""
    try:
        asyncio.run(_run(options, metrics, config))
    except ServerAlreadyRunning as exc:
        print(f"tiercache serve: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags of the standalone entry point (the segment given directly) and serve."""
    ap = argparse.ArgumentParser(prog="python -m tiercache.server", description=__doc__)
    ap.add_argument("--socket", required=True, help="Unix socket path")
    ap.add_argument("--capacity", type=int, help="bytes of the shared segment (default: 1 GiB)")
    ap.add_argument(
        "--slot-bytes", type=int, action="append", default=[], help="a size class to make at start"
    )
    ap.add_argument(
        "--slots", type=int, help="exactly this many slots of the (first) --slot-bytes: one slot per region"
    )
    ap.add_argument("--region-bytes", type=int, help="bytes of one region (the largest object)")
    ap.add_argument("--mode", type=lambda s: int(s, 8), default=0o600, help="socket file mode (octal)")
    ap.add_argument("--group", type=int, default=None, help="gid owning the socket; its members are allowed")
    ap.add_argument("--allow-uid", type=int, action="append", default=[], help="allowed peer uid (repeat)")
    ap.add_argument("--admin-group", type=int, default=None, help="gid whose members may CLEAR and DRAIN")
    ap.add_argument("--max-clients", type=int, default=1024, help="connections served at once")
    ap.add_argument("--max-leases", type=int, default=Caps().max_leases, help="read leases per connection")
    ap.add_argument(
        "--max-share", type=float, default=Caps().max_share, help="fraction of the segment per connection"
    )
    ap.add_argument("--orphan-grace-s", type=float, default=60.0, help="see server.orphan_grace_s")
    ap.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="lowest level logged to stderr",
    )
    args = ap.parse_args(argv)
    setup_server_logging(args.log_level)
    capacity = args.capacity or 1 << 30
    region = args.region_bytes
    if args.slots is not None:
        if not args.slot_bytes:
            ap.error("--slots needs --slot-bytes")
        region = max(stride_of(args.slot_bytes[0]), 4096)
        capacity = args.slots * region
    options = ServerOptions(
        socket_path=args.socket,
        capacity=capacity,
        slot_bytes=tuple(args.slot_bytes),
        region_bytes=region,
        mode=args.mode,
        group=args.group,
        allowed_uids=frozenset(args.allow_uid),
        admin_group=args.admin_group,
        caps=Caps(args.max_leases, args.max_share),
        max_clients=args.max_clients,
        orphan_grace_s=args.orphan_grace_s,
    )
    return run_server(options)
