"""The raw codec: the array's bytes, unchanged (ARRAY_TO_BYTES, lossless)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from tiercache.buffers import copy_bytes
from tiercache.serde._codec import Codec, CodecContext, Stage

if TYPE_CHECKING:
    from tiercache.spec import KVSpec

__all__ = ["RawCodec"]


class RawCodec(Codec):
    """Identity: the payload is the C-contiguous bytes of the KV array."""

    codec_id: ClassVar[str] = "raw"
    stage: ClassVar[Stage] = Stage.ARRAY_TO_BYTES
    lossless: ClassVar[bool] = True

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """Exactly the input size."""
        return nbytes

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Copy ``src`` into ``dst`` (a large copy with the GIL released: ``copy_bytes``)."""
        n = len(src)
        copy_bytes(dst[:n], src)
        return n

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Copy ``src`` (exactly ``len(dst)`` bytes) into ``dst``."""
        if len(src) != len(dst):
            raise ValueError(f"raw payload of {len(src)} bytes for a {len(dst)}-byte array")
        copy_bytes(dst, src)
        return len(src)
