"""Run one :class:`L1Server` until SIGTERM/SIGINT: ``python -m tiercache.server`` and ``tiercache serve``."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiercache.server.segment import SlotClass
from tiercache.server.server import L1Server, ServerAlreadyRunning, ServerOptions

if TYPE_CHECKING:
    from tiercache.config import Config

__all__ = ["main", "run_server"]


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
    try:
        server = L1Server(options, tiers=tiers, policy=None if config is None else config.manager)
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
    """Parse the flags of the standalone entry point (the slot layout given directly) and serve."""
    ap = argparse.ArgumentParser(prog="python -m tiercache.server", description=__doc__)
    ap.add_argument("--socket", required=True, help="Unix socket path")
    ap.add_argument("--slot-bytes", type=int, required=True, help="bytes of one slot")
    ap.add_argument("--slots", type=int, required=True, help="number of slots")
    ap.add_argument("--mode", type=lambda s: int(s, 8), default=0o600, help="socket file mode (octal)")
    ap.add_argument("--group", type=int, default=None, help="gid owning the socket; its members are allowed")
    ap.add_argument("--allow-uid", type=int, action="append", default=[], help="allowed peer uid (repeat)")
    args = ap.parse_args(argv)
    options = ServerOptions(
        socket_path=args.socket,
        slot_classes=[SlotClass(args.slot_bytes, args.slots)],
        mode=args.mode,
        group=args.group,
        allowed_uids=frozenset(args.allow_uid),
    )
    return run_server(options)
