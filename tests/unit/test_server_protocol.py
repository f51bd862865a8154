"""tiercache.server.protocol: round trips, strict validation; the decoder only ever raises ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.server.protocol import (
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_MESSAGE,
    MAX_WAIT_S,
    PROTOCOL_VERSION,
    Message,
    Op,
    ProtocolError,
    decode,
    encode,
)


def _raw(*fields: object) -> bytes:
    data: bytes = msgpack.packb(list(fields), use_bin_type=True)
    return data


def test_round_trip_of_every_request() -> None:
    bodies = {
        Op.HELLO: {"role": "worker", "slot_bytes": [4096], "fence": [b"s" * 16]},
        Op.FENCE: {"sessions": [b"t" * 16]},
        Op.LOOKUP: {
            "keys": ["a", "b"],
            "pin": True,
            "prefix": False,
            "l2": True,
            "prefetch": False,
            "wait_s": 1.5,
        },
        Op.ALLOC: {"keys": ["a"], "nbytes": [64], "meta": [b"\x01"]},
        Op.COMMIT: {"slots": [[3, 7]]},
        Op.ABORT: {"slots": [[0, 0], [1, 2]]},
        Op.RELEASE: {"leases": [5, 6]},
        Op.END: {},
        Op.STATS: {},
        Op.CLEAR: {},
        Op.DRAIN: {"timeout_s": 2.5},
    }
    for op, body in bodies.items():
        msg = decode(encode(op, 42, 9, body))
        expected = {**body, "slots": [tuple(r) for r in body["slots"]]} if "slots" in body else body
        assert msg == Message(42, op, 9, expected)


def test_lookup_l2_fields_are_optional_with_defaults() -> None:
    """An L1-only client leaves l2 / prefetch / wait_s out: no L2, no wait."""
    msg = decode(encode(Op.LOOKUP, 1, 2, {"keys": ["a"], "pin": False, "prefix": True}))
    assert msg.body == {
        "keys": ["a"],
        "pin": False,
        "prefix": True,
        "l2": False,
        "prefetch": False,
        "wait_s": 0.0,
    }
    assert decode(encode(Op.DRAIN, 1, 2, {"timeout_s": 3})).body == {"timeout_s": 3.0}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "not a msgpack"),
        (b"\xc1", "not a msgpack"),
        (_raw(PROTOCOL_VERSION, 0, 2, 1), "[version, epoch, op, req_id, body]"),
        (_raw(PROTOCOL_VERSION + 1, 0, 8, 1, {}), "protocol version"),
        (_raw(PROTOCOL_VERSION, -1, 8, 1, {}), "epoch"),
        (_raw(PROTOCOL_VERSION, 0, 99, 1, {}), "unknown op"),
        (_raw(PROTOCOL_VERSION, 0, 64, 1, {}), "not a request"),
        (_raw(PROTOCOL_VERSION, 0, 2, 1, []), "body must be a map"),
        (_raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["a"], "pin": 1, "prefix": False}), "pin must be a bool"),
        (_raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": [""], "pin": True, "prefix": False}), "non-empty str"),
        (
            _raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["k" * (MAX_KEY_LEN + 1)], "pin": True, "prefix": True}),
            "key",
        ),
        (
            _raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["a"] * (MAX_KEYS + 1), "pin": True, "prefix": True}),
            "list",
        ),
        (_raw(PROTOCOL_VERSION, 0, 3, 1, {"keys": ["a"], "nbytes": [], "meta": []}), "differ in length"),
        (_raw(PROTOCOL_VERSION, 0, 3, 1, {"keys": ["a"], "nbytes": [-1], "meta": [b""]}), "nbytes"),
        (
            _raw(PROTOCOL_VERSION, 0, 3, 1, {"keys": ["a"], "nbytes": [1], "meta": ["s"]}),
            "meta must be bytes",
        ),
        (_raw(PROTOCOL_VERSION, 0, 4, 1, {"slots": [[1]]}), "[slot, generation]"),
        (_raw(PROTOCOL_VERSION, 0, 4, 1, {"slots": [[1, True]]}), "generation"),
        (_raw(PROTOCOL_VERSION, 0, 6, 1, {"leases": ["x"]}), "lease"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {}), "HELLO needs role"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {"role": "root"}), "HELLO needs role, one of"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {"role": ["worker"]}), "HELLO needs role, one of"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {"role": "worker", "fence": [b"short"]}), "session token"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {"role": "worker", "fence": [b"s" * 16] * 65}), "sessions"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {"role": "worker", "slot_bytes": [-4]}), "slot_bytes"),
        (_raw(PROTOCOL_VERSION, 0, 1, 1, {"role": "worker", "slot_bytes": [1] * 17}), "slot_bytes"),
        (_raw(PROTOCOL_VERSION, 0, 11, 1, {"sessions": ["not bytes" * 2]}), "session token"),
        (_raw(PROTOCOL_VERSION, 0, 11, 1, {}), "sessions"),
        (
            _raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["a"], "pin": True, "prefix": False, "l2": 1}),
            "l2 must be a bool",
        ),
        (
            _raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["a"], "pin": True, "prefix": False, "prefetch": "y"}),
            "prefetch must be a bool",
        ),
        (
            _raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["a"], "pin": True, "prefix": False, "wait_s": -1}),
            "wait_s",
        ),
        (
            _raw(
                PROTOCOL_VERSION,
                0,
                2,
                1,
                {"keys": ["a"], "pin": True, "prefix": False, "wait_s": float("nan")},
            ),
            "wait_s",
        ),
        (
            _raw(PROTOCOL_VERSION, 0, 2, 1, {"keys": ["a"], "pin": True, "prefix": False, "wait_s": True}),
            "wait_s",
        ),
        (_raw(PROTOCOL_VERSION, 0, 10, 1, {}), "timeout_s"),
        (_raw(PROTOCOL_VERSION, 0, 10, 1, {"timeout_s": 1e9}), "timeout_s"),
        (_raw(PROTOCOL_VERSION, 0, 10, 1, {"timeout_s": "1"}), "timeout_s"),
        (_raw(PROTOCOL_VERSION, 0, 8, 1, {}) + b"\x00", "not a msgpack"),
        (b"\x00" * (MAX_MESSAGE + 1), "exceeds"),
    ],
)
def test_malformed_messages_are_protocol_errors(data: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert fragment in str(err.value)


def test_encode_refuses_oversized_messages() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(Op.LOOKUP, 0, 1, {"keys": ["k" * 500] * 1000, "pin": False, "prefix": False})


def test_reply_side_accepts_only_replies() -> None:
    assert decode(encode(Op.OK, 1, 2, {"x": 1}), request=False).body == {"x": 1}
    with pytest.raises(ProtocolError, match="not a reply"):
        decode(encode(Op.STATS, 1, 2, {}), request=False)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, Message)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([PROTOCOL_VERSION, 0, "1", None]),
    st.one_of(st.integers(-5, 2**64 - 1), st.text(max_size=3)),
    st.one_of(st.sampled_from([int(o) for o in Op]), st.integers(-3, 200)),
    st.integers(-2, 2**64 - 1),
    st.one_of(
        _msgpack_values,
        st.fixed_dictionaries(
            {
                "keys": _msgpack_values,
                "pin": _msgpack_values,
                "prefix": _msgpack_values,
                "role": _msgpack_values,
            }
        ),
        st.fixed_dictionaries({"keys": _msgpack_values, "nbytes": _msgpack_values, "meta": _msgpack_values}),
        st.fixed_dictionaries({"slots": _msgpack_values, "leases": _msgpack_values}),
        st.fixed_dictionaries(
            {
                "keys": st.lists(st.text(min_size=1, max_size=4), max_size=3),
                "pin": st.booleans(),
                "prefix": st.booleans(),
                "l2": _msgpack_values,
                "prefetch": _msgpack_values,
                "wait_s": _msgpack_values,
                "timeout_s": _msgpack_values,
            }
        ),
    ),
)
def test_fuzz_structured_messages_validate_or_raise_protocol_error(
    version: object, epoch: object, op: object, req_id: object, body: object
) -> None:
    data = _raw(version, epoch, op, req_id, body)
    try:
        msg = decode(data)
    except ProtocolError:
        return
    # Whatever passed validation is well-typed for the server's handlers.
    assert msg.op in Op
    assert msg.epoch >= 0
    assert msg.req_id >= 0
    for key in msg.body.get("keys", []):
        assert isinstance(key, str)
        assert key
    for slot, gen in msg.body.get("slots", []):
        assert type(slot) is int
        assert type(gen) is int
    for flag in ("l2", "prefetch", "pin", "prefix"):
        if flag in msg.body:
            assert type(msg.body[flag]) is bool
    for seconds in ("wait_s", "timeout_s"):
        if seconds in msg.body:
            assert type(msg.body[seconds]) is float
            assert 0 <= msg.body[seconds] <= MAX_WAIT_S
