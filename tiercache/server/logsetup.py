"""The server process's logging: every ``tiercache`` record on stderr as one line with time, level, pid and
logger name, no color (the journal under systemd, the container log under Kubernetes)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from tiercache.config import LOG_LEVELS

__all__ = ["LineFormatter", "setup_server_logging"]

FORMAT = "%(asctime)s %(levelname)s tiercache[%(process)d] %(name)s: %(message)s"


class LineFormatter(logging.Formatter):
    """Formats a record (traceback included) as exactly one line: newlines are written as ``\\n``."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """ISO-8601 local time with milliseconds and the UTC offset."""
        import time

        t = time.localtime(record.created)
        return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}" + time.strftime("%z", t)

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


def setup_server_logging(level: str, stream: TextIO | None = None) -> logging.Handler:
    """Send the ``tiercache`` logger's records at ``level`` (one of ``LOG_LEVELS``) and above to ``stream``
    (default stderr) as one line each; they do not also propagate to the root logger. Returns the handler."""
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(LineFormatter())
    root = logging.getLogger("tiercache")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
    return handler
