"""The zero-copy RESP client's command framing equals redis-py's encoding of the same command."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from redis.connection import PythonRespSerializer

from tiercache.adapters._resp import _command


@given(st.sampled_from([b"GET", b"SET", b"AUTH"]), st.lists(st.binary(max_size=2000), max_size=6))
def test_command_parts_join_to_the_resp_encoding(name: bytes, rest: list[bytes]) -> None:
    args = [name, *rest]  # redis-py splits a command name at spaces: give it a real one
    parts = _command(*args)
    want = b"".join(PythonRespSerializer(6000, lambda x: x).pack(*args))
    assert b"".join(bytes(p) for p in parts) == want
    # a large argument is sent from the caller's buffer itself, never copied into the framing
    for arg in args:
        if len(arg) > 512:
            assert any(p.obj is arg for p in parts)


@given(st.lists(st.binary(max_size=1500), min_size=1, max_size=4), st.binary(max_size=40))
def test_a_tuple_argument_is_one_bulk_string_of_its_buffers(pieces: list[bytes], key: bytes) -> None:
    """A value given as several buffers (a part and its nonce) is framed as their concatenation, and a large
    piece is still sent from the caller's buffer."""
    parts = _command(b"SET", key, tuple(pieces))
    want = b"".join(PythonRespSerializer(6000, lambda x: x).pack(b"SET", key, b"".join(pieces)))
    assert b"".join(bytes(p) for p in parts) == want
    for piece in pieces:
        if len(piece) > 512:
            assert any(p.obj is piece for p in parts)
