"""Frame header: pack/read round trip and every rejection read_header must make."""

from __future__ import annotations

import hashlib
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.errors import FrameError
from tiercache.serde import FrameHeader, read_header
from tiercache.serde.frame import (
    FIXED_SIZE,
    TRAILER_SIZE,
    key_fingerprint,
    pack_header,
    pack_static_header,
    payload_checksum,
)
from tiercache.spec import KVFormat, KVSpec
from tiercache.testing.codecs import kv_specs

SPEC = KVSpec(4, 2, 8, "float16", KVFormat.KV_2LTD, tokens=7, layer_start=1, layer_end=3)
CHAIN = [("raw", b""), ("zstd", b"\x03"), ("aesgcm", b"")]
KEY = "tc1.frame.test"


def _header(spec: KVSpec = SPEC, chain: list[tuple[str, bytes]] = CHAIN, payload_len: int = 10) -> bytes:
    return pack_header(spec, chain, KEY, payload_len, 0x1122334455667788)


def _reseal(buf: bytearray) -> bytearray:
    """Recompute the header crc after a deliberate edit, so the test reaches the field check itself."""
    (header_len,) = struct.unpack_from("<H", buf, 6)
    struct.pack_into("<I", buf, header_len - 4, zlib.crc32(buf[: header_len - 4]))
    return buf


def test_round_trip() -> None:
    raw = _header()
    header = read_header(raw)
    assert header == FrameHeader(
        spec=SPEC,
        chain=("raw", "zstd", "aesgcm"),
        chain_params=(b"", b"\x03", b""),
        payload_len=10,
        raw_len=SPEC.nbytes,
        checksum=0x1122334455667788,
        key_fingerprint=key_fingerprint(KEY),
        header_len=len(raw),
        version=1,
    )
    assert len(raw) == FIXED_SIZE + (1 + 3 + 2) + (1 + 4 + 2 + 1) + (1 + 6 + 2) + TRAILER_SIZE
    assert header.static_len == len(raw) - TRAILER_SIZE
    assert raw[: header.static_len] == pack_static_header(SPEC, CHAIN, KEY)
    assert header.frame_len == len(raw) + 10


@settings(max_examples=50, deadline=None)
@given(spec=kv_specs(), payload_len=st.integers(0, 2**64 - 1), checksum=st.integers(0, 2**64 - 1))
def test_round_trip_any_spec(spec: KVSpec, payload_len: int, checksum: int) -> None:
    header = read_header(pack_header(spec, [("raw", b"")], KEY, payload_len, checksum))
    assert (header.spec, header.payload_len, header.checksum) == (spec, payload_len, checksum)


def test_payloads_over_4gib_are_representable() -> None:
    big = KVSpec(80, 8, 128, "float32", tokens=8192)  # a 5 GiB array
    header = read_header(_header(big, payload_len=5 << 30))
    assert header.payload_len == 5 << 30
    assert header.raw_len == big.nbytes > 4 << 30


def test_key_fingerprint_is_sha256_prefix() -> None:
    assert key_fingerprint("abc") == int.from_bytes(hashlib.sha256(b"abc").digest()[:8], "little")
    assert key_fingerprint("abc") != key_fingerprint("abd")


def test_payload_checksum_is_xxh3() -> None:
    import xxhash

    assert payload_checksum(b"hello") == xxhash.xxh3_64_intdigest(b"hello")


def test_accepts_memoryviews_of_any_format() -> None:
    raw = _header()
    assert read_header(memoryview(raw)).spec == SPEC
    assert read_header(memoryview(raw).cast("c")).spec == SPEC
    assert read_header(bytearray(raw) + b"payload").spec == SPEC
    spaced = bytes(b for c in raw for b in (c, 0))
    assert read_header(memoryview(spaced)[::2]).spec == SPEC


@pytest.mark.parametrize("n", [0, 1, 4, FIXED_SIZE, FIXED_SIZE + TRAILER_SIZE - 1])
def test_too_short(n: int) -> None:
    with pytest.raises(FrameError, match="truncated"):
        read_header(_header()[:n])


def test_truncated_inside_chain() -> None:
    raw = _header()
    with pytest.raises(FrameError, match="truncated"):
        read_header(raw[:-1])


def test_bad_magic() -> None:
    with pytest.raises(FrameError, match="magic"):
        read_header(b"TCKW" + _header()[4:])


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [
        (4, "<H", 2, "version"),
        (8, "<H", 1, "flags"),
        (14, "<H", 1, "reserved"),
        (12, "<B", 2, "checksum kind"),
        (11, "<B", 99, "dtype code"),
        (10, "<B", 9, "invalid KV spec"),
        (16, "<I", 0, "invalid KV spec"),  # zero layers
        (36, "<I", 9, "invalid KV spec"),  # layer_end > num_layers
        (40, "<Q", 1, "raw length"),
        (13, "<B", 0, "no codecs"),
        (13, "<B", 2, "stray bytes"),
        (13, "<B", 4, "overrun"),
        (56, "<B", 0, "overrun"),  # zero-length codec id
        (57, "<B", 0xFF, "non-ASCII"),
        (60, "<H", 0xFF, "overrun"),  # params length past the chain
    ],
)
def test_field_checks(offset: int, fmt: str, value: int, match: str) -> None:
    buf = bytearray(_header())
    struct.pack_into(fmt, buf, offset, value)
    with pytest.raises(FrameError, match=match):
        read_header(_reseal(buf) if offset != 4 else buf)


def test_unsupported_version_even_with_valid_crc() -> None:
    buf = bytearray(_header())
    struct.pack_into("<H", buf, 4, 2)
    with pytest.raises(FrameError, match="version 2"):
        read_header(_reseal(buf))


def test_header_length_checks() -> None:
    buf = bytearray(_header())
    struct.pack_into("<H", buf, 6, FIXED_SIZE)
    with pytest.raises(FrameError, match="header length"):
        read_header(buf)
    struct.pack_into("<H", buf, 6, 0xFFFF)
    with pytest.raises(FrameError, match="truncated"):
        read_header(buf)


def test_every_header_bit_is_protected() -> None:
    raw = _header()
    for pos in range(len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[pos] ^= 1 << bit
            with pytest.raises(FrameError):
                read_header(bad)


def test_pack_rejects_unrepresentable() -> None:
    with pytest.raises(ValueError, match=r"1\.\.255"):
        pack_static_header(SPEC, [], KEY)
    with pytest.raises(ValueError, match=r"1\.\.255"):
        pack_static_header(SPEC, [("raw", b"")] * 256, KEY)
    with pytest.raises(ValueError, match="do not fit"):
        pack_static_header(SPEC, [("x" * 256, b"")], KEY)
    with pytest.raises(ValueError, match="do not fit"):
        pack_static_header(SPEC, [("raw", bytes(0x10000))], KEY)
    with pytest.raises(ValueError, match="exceeds"):
        pack_static_header(SPEC, [("raw", bytes(0xFFFF))], KEY)
    with pytest.raises(UnicodeEncodeError):
        pack_static_header(SPEC, [("räw", b"")], KEY)
    with pytest.raises(ValueError, match="does not fit"):
        pack_static_header(KVSpec(1, 1, 1, "uint8", tokens=2**32), [("raw", b"")], KEY)
