"""Temp files that name their writer, so a sweep removes only those whose writer is gone.

A writer's temp file is ``.<key>.<owner>.<serial>.tmp`` with ``owner = <host>_<pid>_<start>``: ``host``
an 8-hex digest of the host name, ``start`` the process start time in clock ticks since boot
(``/proc/<pid>/stat`` field 22), so a recycled pid is not mistaken for the writer. A temp file is *dead*
when its writer is a process of this host that no longer runs (or runs with another start time); a file of
another host, or with no owner in its name (older versions), is dead once it has not been modified for
``stale_s`` seconds.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import socket
import time
from functools import cache

import xxhash

__all__ = ["TMP_SUFFIX", "TempFileState", "is_temp_name", "owner_tag", "temp_name", "temp_state"]

TMP_SUFFIX = ".tmp"
_OWNER_RE = re.compile(r"^([0-9a-f]{8})_(\d+)_(\d+)$")


@cache
def _host() -> str:
    return xxhash.xxh32_hexdigest(socket.gethostname().encode())


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # no procfs here: fall back to "is there such a pid"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line; the 3rd after the command name


_owner: str | None = None  # this process's tag, made on first use; a forked child starts without one


def _forget_owner() -> None:
    global _owner
    _owner = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_owner)


def owner_tag() -> str:
    """This process's owner tag (host, pid, start time); a forked child gets its own. No system call once
    made (a put names a temp file with it)."""
    global _owner
    if _owner is None:
        pid = os.getpid()
        _owner = f"{_host()}_{pid}_{_start_ticks(pid) or 0}"
    return _owner


_serial = itertools.count(secrets.randbits(32))  # the part after the owner: unique within the process


def temp_name(key: str) -> str:
    """A fresh temp file name for ``key`` written by this process (its owner tag and a serial number, so
    no two writers of any process share one; no random bytes drawn per name)."""
    return f".{key}.{owner_tag()}.{next(_serial):x}{TMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temp file of this layout (any version)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


class TempFileState:
    """What a sweep decides for one temp file."""

    LIVE = "live"
    DEAD = "dead"


def temp_state(name: str, mtime: float, stale_s: float, now: float | None = None) -> str:
    """``TempFileState.LIVE`` or ``DEAD`` for the temp file ``name`` last modified at ``mtime``."""
    parts = name[1 : -len(TMP_SUFFIX)].rsplit(".", 2)
    m = _OWNER_RE.match(parts[1]) if len(parts) == 3 else None
    if m is not None and m.group(1) == _host():
        pid, start = int(m.group(2)), int(m.group(3))
        running = _start_ticks(pid)
        alive = running is not None and (running == start or start == 0 or running == 0)
        return TempFileState.LIVE if alive else TempFileState.DEAD
    age = (time.time() if now is None else now) - mtime
    return TempFileState.DEAD if age > stale_s else TempFileState.LIVE
