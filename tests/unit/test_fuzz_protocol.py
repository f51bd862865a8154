"""Fuzzing the server's wire messages (short run; the long run is ``make fuzz``): a mutated or random message
is a ``Message`` or ``ProtocolError``, never another exception, and an accepted request means exactly what
was sent (it re-encodes to the same bytes)."""

from __future__ import annotations

from tiercache.testing.harness import fuzz


def test_short_fuzz_loop_has_no_findings() -> None:
    result = fuzz.run_target("protocol", 20000, seed=1)
    assert result["findings"] == []
    assert set(result["outcomes"]) == {"accepted", "rejected"}  # both sides of the oracle were reached


def test_the_oracle_catches_a_decoder_that_lets_a_bad_field_through() -> None:
    target = fuzz.ProtocolFuzz()
    hello = target.p.encode(target.p.Op.HELLO, 1, 1, {"role": "worker"})
    assert target.check(hello, request=True) == "accepted"
    assert target.check(hello[:-3], request=True) == "rejected"  # a truncated message
