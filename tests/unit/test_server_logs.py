"""RateLimitedLog: one line per key per interval, the suppressed count on the next line (an injected clock);
and a real server flooded with malformed messages.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tiercache.server.client import ServerConnection
from tiercache.server.logs import RateLimitedLog
from tiercache.server.protocol import Op
from tiercache.testing.fakes import FakeClock
from tiercache.testing.harness.processes import NodeServer


class Lines(logging.Handler):
    """Keeps every record that reaches the logger, formatted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def logger(request: pytest.FixtureRequest) -> logging.Logger:
    log = logging.getLogger(f"tiercache.test.ratelimit.{request.node.name}")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    return log


@pytest.fixture
def lines(logger: logging.Logger) -> Lines:
    handler = Lines()
    logger.addHandler(handler)
    return handler


def test_one_line_per_key_per_interval_then_the_suppressed_count(
    logger: logging.Logger, lines: Lines
) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logger, interval_s=10.0, clock=clock)
    assert rl.warning("proto", "protocol error from pid %d: %s", 11, "bad op")
    for pid in range(12, 17):  # 5 more within the interval: held back
        clock.now += 1.0
        assert not rl.warning("proto", "protocol error from pid %d: %s", pid, "bad op")
    assert lines.lines == ["protocol error from pid 11: bad op"]
    clock.now = 1009.999  # still inside the interval of the first line
    assert not rl.warning("proto", "protocol error from pid %d: %s", 17, "bad op")
    clock.now = 1010.0  # the interval has passed: emitted, with the count of the 6 held back
    assert rl.warning("proto", "protocol error from pid %d: %s", 18, "bad op")
    assert (
        lines.lines[1] == "protocol error from pid 18: bad op (6 similar lines suppressed in the last 10.0 s)"
    )
    assert [r.levelno for r in lines.records] == [logging.WARNING, logging.WARNING]
    assert rl.suppressed_total == 6
    clock.now += 10.0  # nothing held back since the last line: no count appended
    assert rl.warning("proto", "protocol error from pid %d: %s", 19, "bad op")
    assert lines.lines[2] == "protocol error from pid 19: bad op"


def test_the_interval_runs_from_the_last_emitted_line(logger: logging.Logger, lines: Lines) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logger, interval_s=5.0, clock=clock)
    emitted = []
    for _ in range(40):  # a line every second for 40 s: one emitted every 5 s
        emitted.append(rl.info("lost", "connection lost"))
        clock.now += 1.0
    assert emitted == [i % 5 == 0 for i in range(40)]
    assert lines.lines[0] == "connection lost"
    assert lines.lines[1:] == ["connection lost (4 similar lines suppressed in the last 5.0 s)"] * 7
    assert all(r.levelno == logging.INFO for r in lines.records)


def test_keys_are_independent(logger: logging.Logger, lines: Lines) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logger, interval_s=60.0, clock=clock)
    assert rl.warning("refused", "refused peer uid %d", 1000)
    assert rl.warning("proto", "protocol error")
    assert not rl.warning("refused", "refused peer uid %d", 1001)
    assert rl.error(("peer", 7), "peer %d misbehaves", 7)  # any hashable key
    assert rl.warning(("peer", 8), "peer %d misbehaves", 8)
    assert not rl.warning(("peer", 7), "peer %d misbehaves", 7)
    assert lines.lines == [
        "refused peer uid 1000",
        "protocol error",
        "peer 7 misbehaves",
        "peer 8 misbehaves",
    ]
    assert lines.records[2].levelno == logging.ERROR


def test_a_message_without_args_stays_literal(logger: logging.Logger, lines: Lines) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logger, interval_s=1.0, clock=clock)
    rl.warning("disk", "disk 100% full")
    rl.warning("disk", "disk 100% full")
    clock.now += 1.0
    rl.warning("disk", "disk 100% full")
    assert lines.lines == ["disk 100% full", "disk 100% full (1 similar lines suppressed in the last 1.0 s)"]


def test_a_disabled_level_counts_nothing(logger: logging.Logger, lines: Lines) -> None:
    clock = FakeClock()
    logger.setLevel(logging.WARNING)
    rl = RateLimitedLog(logger, interval_s=10.0, clock=clock)
    for _ in range(3):
        assert not rl.info("k", "debugging")
    assert rl.suppressed_total == 0
    assert rl.warning("k", "a warning")  # the INFO calls neither logged nor started the key's interval
    assert lines.lines == ["a warning"]


def test_flush_reports_pending_counts_once(logger: logging.Logger, lines: Lines) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logger, interval_s=10.0, clock=clock)
    rl.warning("a", "line a")
    rl.warning("a", "line a")
    rl.warning("a", "line a")
    rl.info("b", "line b")
    clock.now += 2.5
    assert rl.flush() == 1  # only "a" has held-back lines
    assert lines.lines[-1] == "a: 2 similar lines suppressed in the last 2.5 s"
    assert lines.records[-1].levelno == logging.WARNING
    assert rl.flush() == 0
    clock.now += 10.0
    rl.warning("a", "line a")  # the flushed count is not repeated
    assert lines.lines[-1] == "line a"


def test_keys_are_bounded(logger: logging.Logger, lines: Lines) -> None:
    clock = FakeClock()
    rl = RateLimitedLog(logger, interval_s=100.0, clock=clock, max_keys=3)
    assert rl.warning(0, "key %d", 0)
    clock.now += 50.0
    assert rl.warning(1, "key %d", 1)
    assert rl.warning(2, "key %d", 2)
    clock.now += 50.0
    assert rl.warning(0, "key %d", 0)  # its interval passed: emitted, now the most recently emitted key
    assert rl.warning(3, "key %d", 3)  # a fourth key forgets the least recently emitted one: 1
    assert len(rl._keys) == 3
    assert not rl.warning(0, "key %d", 0)  # tracked, within the interval
    assert not rl.warning(2, "key %d", 2)
    assert not rl.warning(3, "key %d", 3)
    assert rl.warning(1, "key %d", 1)  # forgotten: emitted at once, within what was its interval
    assert lines.lines == ["key 0", "key 1", "key 2", "key 0", "key 3", "key 1"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(logging.getLogger("x"), interval_s=0)
    with pytest.raises(ValueError, match="max_keys"):
        RateLimitedLog(logging.getLogger("x"), max_keys=0)


def test_the_record_names_the_callers_line() -> None:
    """The emitted record points at the caller (file and function), not at logs.py: what an operator greps."""
    script = textwrap.dedent(
        """
        import logging, sys
        from tiercache.server.logs import RateLimitedLog
        logging.basicConfig(stream=sys.stdout, format="%(filename)s:%(funcName)s:%(message)s")
        rl = RateLimitedLog(logging.getLogger("srv"), interval_s=3600)
        def serve():
            for i in range(1000):
                rl.warning("proto", "protocol error %d", i)
                rl.log(logging.ERROR, "other", "other %d", i)
        serve()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.splitlines() == ["<string>:serve:protocol error 0", "<string>:serve:other 0"]


def test_a_server_flooded_with_bad_messages_logs_a_few_lines(sock_dir: Path) -> None:
    """A real server child: 300 connections each dropped for a malformed message are all counted (STATS), and
    the log gets one line per 10 s interval, not one per connection."""
    path = str(sock_dir / "flood.sock")
    server = NodeServer(path)
    start = time.monotonic()
    try:
        assert server.ready
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(60)
            s.connect(path)
            s.send(b"\xc1 not msgpack")
            s.recv(65536)  # the error reply (or EOF): the server handled this one
            assert s.recv(65536) == b""  # dropped
            s.close()
        conn = ServerConnection(path, role="probe", timeout_s=60)
        assert conn.request(Op.STATS, {})["protocol_errors"] == 300
        conn.close()
    finally:
        server.stop()
    elapsed = time.monotonic() - start
    err = server.log()
    lines = [line for line in err.splitlines() if "protocol error" in line]
    assert 1 <= len(lines) <= 1 + int(elapsed // 10)
    assert len(err.splitlines()) < 20
