"""The lz4 codec: LZ4 block compression, stored raw when it saves less than 1/64 (BYTES_TO_BYTES, lossless).

Output: one flag byte, then

- flag 0 (stored): the input bytes unchanged;
- flag 1 (lz4): u64 little-endian input length, then one LZ4 block.

The compressed form is kept only when its whole output (flag and length included) is at most 63/64 of the
input (plain bf16 KV does not compress with LZ4: it is then stored, costing one byte and a memcpy on decode).
Needs the ``lz4`` package (``pip install 'tiercache[codecs]'``), imported when the codec is loaded.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

import lz4.block
import numpy as np

from tiercache.serde._codec import Codec, CodecContext, Stage, int_option
from tiercache.serde._stored import FLAG_COMPRESSED, FLAG_STORED, read_stored, worth_compressing, write_stored

if TYPE_CHECKING:
    from typing import Self

    from tiercache.spec import KVSpec

__all__ = ["FLAG_COMPRESSED", "FLAG_STORED", "Lz4Codec", "decompress_into", "worth_compressing"]

_LEN = struct.Struct("<Q")
_MAX_INPUT = 0x7E000000  # LZ4_MAX_INPUT_SIZE: larger inputs are stored
_MODES = ("default", "fast", "high_compression")


def _bind_decompress_safe() -> Callable[[int, int, int, int], int] | None:
    """``LZ4_decompress_safe(src, dst, src_size, dst_capacity)`` of the liblz4 that python-lz4 bundles (it
    exports the symbol), called through ctypes without the GIL; None when it cannot be bound."""
    try:
        fn = ctypes.CDLL(lz4.block._block.__file__).LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_DECOMPRESS_SAFE = _bind_decompress_safe()


def _address(buf: memoryview) -> int:
    """Address of a C-contiguous buffer (read-only ones included)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def decompress_into(block: memoryview, dst: memoryview, n: int) -> None:
    """Decode one LZ4 ``block`` of ``n`` decoded bytes straight into ``dst[:n]`` (no intermediate bytes
    object; the library's own call where the C function is not bound). ``ValueError`` on a malformed block."""
    if _DECOMPRESS_SAFE is None or dst.readonly or not block.c_contiguous or not dst.c_contiguous:
        out = lz4.block.decompress(block, uncompressed_size=n)
        if len(out) != n:
            raise ValueError(f"lz4 block decoded to {len(out)} bytes, expected {n}")
        dst[:n] = out
        return
    if n == 0 or len(block) == 0 or len(block) > 0x7FFFFFFF:
        raise ValueError("malformed lz4 block")
    got = _DECOMPRESS_SAFE(_address(block), _address(dst[:n]), len(block), n)
    if got != n:
        raise ValueError(f"malformed lz4 block (decoded {got} bytes, expected {n})")


class Lz4Codec(Codec):
    """LZ4 block compression with a stored fallback; see the module doc."""

    codec_id: ClassVar[str] = "lz4"
    stage: ClassVar[Stage] = Stage.BYTES_TO_BYTES
    lossless: ClassVar[bool] = True
    config_options: ClassVar[tuple[str, ...]] = ("acceleration",)

    def __init__(self, acceleration: int = 1) -> None:
        """``acceleration``: LZ4 acceleration (1 = default; higher = faster, less compression)."""
        self.acceleration = int_option("lz4", "acceleration", acceleration, 1, 65537)

    @classmethod
    def validate_config(cls, config: Mapping[str, object]) -> None:
        """Check option names and values."""
        cls.from_config(config)

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        """Build from ``{"id": "lz4", "acceleration": 1}``."""
        options = cls.check_options(config)
        return cls(int_option("lz4", "acceleration", options.get("acceleration", 1), 1, 65537))

    def get_config(self) -> dict[str, object]:
        """The acceleration."""
        return {"id": self.codec_id, "acceleration": self.acceleration}

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """Input plus the flag byte (the compressed form is only kept when smaller)."""
        return nbytes + 1

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Compress into ``dst``, or store when the saving is below 1/64."""
        n = len(src)
        if 0 < n <= _MAX_INPUT:
            if self.acceleration == 1:
                packed = lz4.block.compress(src, store_size=False)
            else:
                packed = lz4.block.compress(
                    src, mode="fast", acceleration=self.acceleration, store_size=False
                )
            total = 1 + _LEN.size + len(packed)
            if worth_compressing(total, n):
                dst[0] = FLAG_COMPRESSED
                _LEN.pack_into(dst, 1, n)
                dst[1 + _LEN.size : total] = packed
                return total
        return write_stored(src, dst)

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Decompress (or copy) into ``dst``; ValueError on a malformed payload."""
        stored = read_stored(src, dst, "lz4")
        if stored is not None:
            return stored
        if len(src) < 1 + _LEN.size:
            raise ValueError("truncated lz4 payload")
        n = int(_LEN.unpack_from(src, 1)[0])
        if n > len(dst) or n > _MAX_INPUT:
            raise ValueError(f"lz4 payload of {n} bytes overruns a {len(dst)}-byte destination")
        decompress_into(src[1 + _LEN.size :], dst, n)
        return n
