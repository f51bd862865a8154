"""The frame format: a self-describing, versioned, checksummed header followed by the encoded payload.

All integers are little-endian. Format version 1:

========  ======  ===================================================================================
offset    type    field
========  ======  ===================================================================================
0         4s      magic ``b"TCKV"``
4         u16     format version (1)
6         u16     header length H: the whole header, chain and trailer included
8         u16     flags (none defined in version 1: must be 0)
10        u8      KVFormat (1 = KV_2LTD, 2 = KV_MLA)
11        u8      dtype code (``tiercache.spec.DTYPE_CODES``)
12        u8      payload checksum kind (1 = xxh3_64)
13        u8      chain length N (number of codecs, 1..255)
14        u16     reserved (0)
16        u32     num_layers (of the model)
20        u32     num_kv_heads
24        u32     head_dim
28        u32     tokens
32        u32     layer_start
36        u32     layer_end (exclusive)
40        u64     raw array length (``spec.nbytes``)
48        u64     key fingerprint: first 8 bytes of SHA-256(key, UTF-8), read as u64
56        ...     chain, N entries in encode order: u8 id length, ASCII id, u16 params length, params
H-20      u64     payload length P
H-12      u64     payload checksum (xxh3_64 of the payload)
H-4       u32     header checksum: zlib.crc32 of header bytes [0, H-4)
H         P       payload
========  ======  ===================================================================================

The *static header* is bytes [0, H-20): everything that does not depend on the payload. It is the associated
data (``CodecContext.aad``) given to codecs, so an AEAD codec binds the spec, chain and key fingerprint.
A frame is exactly H + P bytes; anything shorter or longer is rejected.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from tiercache.buffers import as_readable_bytes
from tiercache.errors import FrameError
from tiercache.spec import DTYPE_CODES, KVFormat, KVSpec

__all__ = [
    "CHECKSUM_XXH3_64",
    "FORMAT_VERSION",
    "MAGIC",
    "TRAILER_SIZE",
    "FrameHeader",
    "key_fingerprint",
    "pack_header",
    "pack_static_header",
    "payload_checksum",
    "read_header",
    "seal_header_into",
]

MAGIC = b"TCKV"
FORMAT_VERSION = 1
CHECKSUM_XXH3_64 = 1
_FIXED = struct.Struct("<4sHHHBBBBHIIIIIIQQ")
_TRAILER = struct.Struct("<QQI")
_TAIL = struct.Struct("<QQ")  # payload length, payload checksum (the crc follows)
_CRC = struct.Struct("<I")
FIXED_SIZE = _FIXED.size  # 56
TRAILER_SIZE = _TRAILER.size  # 20
_MAX_HEADER = 0xFFFF
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}

assert FIXED_SIZE == 56
assert TRAILER_SIZE == 20


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The decoded header of one frame (read_header); the payload is not checked here."""

    spec: KVSpec
    chain: tuple[str, ...]
    chain_params: tuple[bytes, ...]
    payload_len: int
    raw_len: int
    checksum: int
    key_fingerprint: int
    header_len: int
    version: int = FORMAT_VERSION
    flags: int = 0
    checksum_kind: int = CHECKSUM_XXH3_64

    @property
    def static_len(self) -> int:
        """Length of the static header (the AAD): the header without payload length, checksum and crc."""
        return self.header_len - TRAILER_SIZE

    @property
    def frame_len(self) -> int:
        """Total length of the frame this header describes."""
        return self.header_len + self.payload_len


def key_fingerprint(key: str) -> int:
    """The u64 a frame stores to bind itself to ``key``: first 8 bytes of SHA-256(key), little-endian."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    """The payload checksum stored in version-1 frames (xxh3_64)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def pack_static_header(spec: KVSpec, chain: Sequence[tuple[str, bytes]], key: str) -> bytes:
    """The static header (AAD) of a frame of ``spec`` under ``key``; ``chain`` is (id, params) pairs."""
    if not 1 <= len(chain) <= 255:
        raise ValueError(f"a frame needs 1..255 codecs, got {len(chain)}")
    entries = bytearray()
    for codec_id, params in chain:
        ident = codec_id.encode("ascii")
        if not 1 <= len(ident) <= 255 or len(params) > 0xFFFF:
            raise ValueError(f"codec id {codec_id!r} or its params ({len(params)} bytes) do not fit a frame")
        entries += struct.pack("<B", len(ident)) + ident + struct.pack("<H", len(params)) + params
    header_len = FIXED_SIZE + len(entries) + TRAILER_SIZE
    if header_len > _MAX_HEADER:
        raise ValueError(f"frame header of {header_len} bytes exceeds {_MAX_HEADER}")
    end = spec.layer_end
    assert end is not None
    try:
        fixed = _FIXED.pack(
            MAGIC, FORMAT_VERSION, header_len, 0, int(spec.format), DTYPE_CODES[spec.dtype], CHECKSUM_XXH3_64,
            len(chain), 0, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.tokens, spec.layer_start,
            end, spec.nbytes, key_fingerprint(key),
        )  # fmt: skip
    except struct.error as exc:
        raise ValueError(f"{spec} does not fit a frame header: {exc}") from None
    return fixed + bytes(entries)


def seal_header_into(buf: bytearray | memoryview, static_len: int, payload_len: int, checksum: int) -> int:
    """Write payload length, checksum and header crc after a static header at ``buf[:static_len]``.

    Returns the header length.
    """
    _TAIL.pack_into(buf, static_len, payload_len, checksum)
    crc_at = static_len + _TAIL.size
    _CRC.pack_into(buf, crc_at, zlib.crc32(memoryview(buf)[:crc_at]))
    return crc_at + _CRC.size


def pack_header(
    spec: KVSpec, chain: Sequence[tuple[str, bytes]], key: str, payload_len: int, checksum: int
) -> bytes:
    """A whole frame header for a payload of ``payload_len`` bytes with checksum ``checksum``."""
    buf = bytearray(pack_static_header(spec, chain, key))
    static_len = len(buf)
    buf += bytes(TRAILER_SIZE)
    seal_header_into(buf, static_len, payload_len, checksum)
    return bytes(buf)


def read_header(frame: bytes | bytearray | memoryview[Any]) -> FrameHeader:
    """Decode and verify a frame header (magic, version, length, crc, fields); FrameError on any fault.

    Only the header is checked: the caller verifies the frame length and payload checksum.
    """
    mv = as_readable_bytes(frame)
    if len(mv) < FIXED_SIZE + TRAILER_SIZE:
        raise FrameError(f"truncated frame: {len(mv)} bytes is shorter than any header")
    if bytes(mv[:4]) != MAGIC:
        raise FrameError(f"bad magic {bytes(mv[:4])!r}, expected {MAGIC!r}")
    (
        _magic, version, header_len, flags, fmt, dtype_code, checksum_kind, count, reserved,
        num_layers, num_kv_heads, head_dim, tokens, layer_start, layer_end, raw_len, fingerprint,
    ) = _FIXED.unpack_from(mv)  # fmt: skip
    if version != FORMAT_VERSION:
        raise FrameError(f"unsupported frame format version {version} (this build reads {FORMAT_VERSION})")
    if header_len < FIXED_SIZE + TRAILER_SIZE:
        raise FrameError(f"bad header length {header_len}")
    if header_len > len(mv):
        raise FrameError(f"truncated frame: header needs {header_len} bytes, frame has {len(mv)}")
    crc_at = header_len - _CRC.size
    (crc,) = _CRC.unpack_from(mv, crc_at)
    if zlib.crc32(mv[:crc_at]) != crc:
        raise FrameError("frame header checksum mismatch")
    if flags != 0 or reserved != 0:
        raise FrameError(f"unknown frame flags {flags:#x} / reserved {reserved:#x}")
    if checksum_kind != CHECKSUM_XXH3_64:
        raise FrameError(f"unknown payload checksum kind {checksum_kind}")
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise FrameError(f"unknown dtype code {dtype_code}")
    try:
        spec = KVSpec(
            num_layers, num_kv_heads, head_dim, dtype, KVFormat(fmt), tokens, layer_start, layer_end
        )
    except ValueError as exc:
        raise FrameError(f"invalid KV spec in frame header: {exc}") from None
    if raw_len != spec.nbytes:
        raise FrameError(f"raw length {raw_len} does not match {spec} ({spec.nbytes} bytes)")
    chain, params = _read_chain(mv, count, header_len - TRAILER_SIZE)
    payload_len, checksum = _TAIL.unpack_from(mv, header_len - TRAILER_SIZE)
    return FrameHeader(
        spec, chain, params, payload_len, raw_len, checksum, fingerprint, header_len, version, flags,
        checksum_kind,
    )  # fmt: skip


def _read_chain(mv: memoryview, count: int, end: int) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    if count == 0:
        raise FrameError("frame names no codecs")
    ids: list[str] = []
    params: list[bytes] = []
    pos = FIXED_SIZE
    for _ in range(count):
        if pos + 1 > end:
            raise FrameError("frame codec chain overruns the header")
        id_len = mv[pos]
        pos += 1
        if id_len == 0 or pos + id_len + 2 > end:
            raise FrameError("frame codec chain overruns the header")
        try:
            ids.append(bytes(mv[pos : pos + id_len]).decode("ascii"))
        except UnicodeDecodeError:
            raise FrameError("non-ASCII codec id in frame") from None
        pos += id_len
        (p_len,) = struct.unpack_from("<H", mv, pos)
        pos += 2
        if pos + p_len > end:
            raise FrameError("frame codec params overrun the header")
        params.append(bytes(mv[pos : pos + p_len]))
        pos += p_len
    if pos != end:
        raise FrameError(f"{end - pos} stray bytes after the frame codec chain")
    return tuple(ids), tuple(params)
