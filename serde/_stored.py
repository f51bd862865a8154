"""The stored-or-compressed framing shared by the compressing codecs (lz4, zstd).

A payload starts with one flag byte: ``FLAG_STORED`` (the input follows verbatim) or ``FLAG_COMPRESSED`` (the
codec's own compressed form follows). A codec stores raw whenever compressing saves less than 1/64.
"""

from __future__ import annotations

__all__ = ["FLAG_COMPRESSED", "FLAG_STORED", "read_stored", "worth_compressing", "write_stored"]

FLAG_STORED = 0
FLAG_COMPRESSED = 1


def worth_compressing(compressed_total: int, nbytes: int) -> bool:
    """True when an encoding of ``compressed_total`` bytes saves at least 1/64 of ``nbytes``."""
    return compressed_total * 64 <= nbytes * 63


def write_stored(src: memoryview, dst: memoryview) -> int:
    """Write ``src`` verbatim behind a ``FLAG_STORED`` byte; returns the payload length."""
    dst[0] = FLAG_STORED
    dst[1 : 1 + len(src)] = src
    return 1 + len(src)


def read_stored(src: memoryview, dst: memoryview, codec_id: str) -> int | None:
    """Copy a stored payload into ``dst`` and return its length; None when the payload is compressed.

    ``ValueError`` for an empty payload, an unknown flag, or a stored payload larger than ``dst``.
    """
    if len(src) < 1:
        raise ValueError(f"empty {codec_id} payload")
    flag = src[0]
    if flag == FLAG_STORED:
        n = len(src) - 1
        if n > len(dst):
            raise ValueError(f"stored payload of {n} bytes overruns a {len(dst)}-byte destination")
        dst[:n] = src[1:]
        return n
    if flag != FLAG_COMPRESSED:
        raise ValueError(f"bad {codec_id} payload flag {flag}")
    return None
