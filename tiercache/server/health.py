"""``tiercache health``: a liveness/readiness probe that exercises the server's socket.

It connects with HELLO role ``"probe"`` (no file descriptors are passed, no segment is mapped) and asks for
STATS; healthy means both answers came within the timeout. For systemd ``ExecStartPost=`` / watchdog scripts
and Kubernetes exec probes: exit 0 healthy, 1 unhealthy, 2 on a usage or config error, one line saying why.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EXIT_OK", "EXIT_UNHEALTHY", "EXIT_USAGE", "HealthResult", "check_health", "run_health"]

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
DEFAULT_TIMEOUT_S = 5.0


@dataclass
class HealthResult:
    """One probe's outcome: ``ok`` when HELLO and STATS were answered within ``timeout_s``."""

    socket: str
    ok: bool
    reason: str
    """One line: what was checked, or why it failed."""
    seconds: float
    """Wall time the probe took (at most about ``timeout_s``)."""
    timeout_s: float
    epoch: int | None = None
    pid: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    """The server's STATS reply (empty unless ok)."""

    def line(self) -> str:
        """The one line for humans and probe logs."""
        return f"tiercache health: {'ok' if self.ok else 'FAIL'}: {self.reason}"

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` object."""
        return {
            "ok": self.ok,
            "socket": self.socket,
            "reason": self.reason,
            "seconds": round(self.seconds, 6),
            "timeout_s": self.timeout_s,
            "epoch": self.epoch,
            "pid": self.pid,
            "stats": self.stats,
        }


def _probe(path: str, timeout_s: float, server_uid: int | None, out: dict[str, Any]) -> None:
    """HELLO (role probe) + STATS; fills ``out`` with the epoch, pid and stats, or the error."""
    from tiercache.server.client import ServerConnection, ServerRefused, ServerUnavailable  # imported already
    from tiercache.server.protocol import Op

    kwargs: dict[str, Any] = {} if server_uid is None else {"server_uid": server_uid}
    try:
        conn = ServerConnection(path, role="probe", timeout_s=timeout_s, **kwargs)
    except ServerRefused as exc:
        if exc.code == "untrusted_server":  # this side refused: the server runs as another uid
            out["error"] = f"untrusted server: {exc}"
        else:
            out["error"] = f"server at {path} refused the probe: {exc}"
        return
    except ServerUnavailable as exc:
        out["error"] = str(exc)
        return
    try:
        out["epoch"], out["pid"] = conn.epoch, getattr(conn, "server_pid", None)
        out["hello"] = True
        out["stats"] = conn.request(Op.STATS, {})
    except ServerUnavailable as exc:  # ServerRefused included
        out["error"] = f"server at {path} answered HELLO but not STATS: {exc}"
    finally:
        conn.close()


def check_health(
    path: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, server_uid: int | None = None
) -> HealthResult:
    """Probe the server on ``path``: healthy when it answers HELLO and STATS within ``timeout_s`` in all.

    The probe runs in a daemon thread so that the whole check, not each socket call, is bounded: a server
    that is stopped (SIGSTOP), hung or overloaded fails after ``timeout_s``. ``server_uid``: the uid the
    server must run as (default: the client's rule, own uid or root).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout_s!r}")
    import tiercache.server.client  # noqa: F401  # before the clock starts: imports are not the server's time

    out: dict[str, Any] = {}
    start = time.monotonic()
    # Each socket call may take a little longer than the whole probe: a server that does not answer is
    # always reported by the deadline below ("no answer to ..."), never by a socket timeout racing it.
    socket_timeout_s = timeout_s + 1.0
    thread = threading.Thread(
        target=_probe, args=(path, socket_timeout_s, server_uid, out), name="tiercache-health", daemon=True
    )
    thread.start()
    thread.join(timeout_s)
    seconds = time.monotonic() - start
    done = not thread.is_alive()
    result = HealthResult(path, False, "", seconds, timeout_s, out.get("epoch"), out.get("pid"))
    if not done:
        what = "STATS" if out.get("hello") else "HELLO"
        result.reason = f"no answer to {what} from the server at {path} within {timeout_s:g} s"
    elif "error" in out:
        result.reason = str(out["error"])
    else:
        stats = dict(out["stats"])
        result.ok, result.stats = True, stats
        clients = stats.get("clients")
        ceiling = stats.get("hit_rate_ceiling")
        result.reason = (
            f"server at {path} answered in {seconds * 1e3:.1f} ms: epoch {result.epoch}, pid {result.pid}"
            + ("" if clients is None else f", {clients} clients")
            + ("" if ceiling is None else f", hit-rate ceiling {ceiling:.2f}")
        )
    return result


def run_health(args: argparse.Namespace) -> int:
    """The ``tiercache health`` handler: 0 healthy, 1 not, 2 on a usage or config error."""
    from tiercache.config import load_config
    from tiercache.errors import TiercacheError

    def fail_usage(message: str) -> int:
        if args.json:
            print(json.dumps({"ok": False, "socket": None, "reason": message, "usage_error": True}))
        else:
            print(f"tiercache health: error: {message}", file=sys.stderr)
        return EXIT_USAGE

    server_uid = None
    socket_path = args.socket
    if args.config:
        try:
            config = load_config(args.config)
        except (TiercacheError, OSError, ValueError) as exc:
            return fail_usage(str(exc))
        socket_path = socket_path or config.server.socket
        uid = getattr(config.server, "server_uid", None)
        if isinstance(uid, str):
            import pwd

            try:
                uid = pwd.getpwnam(uid).pw_uid
            except KeyError:
                return fail_usage(f"{args.config}: server.server_uid: no user named {uid!r}")
        server_uid = uid
    if not socket_path:
        return fail_usage("no socket: pass SOCKET or --config with server.socket")
    if not args.timeout > 0:
        return fail_usage(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    result = check_health(socket_path, timeout_s=args.timeout, server_uid=server_uid)
    if args.json:
        print(json.dumps(result.as_json(), default=str))
    else:
        print(result.line(), file=sys.stdout if result.ok else sys.stderr)
    return EXIT_OK if result.ok else EXIT_UNHEALTHY
