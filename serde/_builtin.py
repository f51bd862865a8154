"""Built-in codecs, registered through the same pluggy hook as third-party ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.hookspecs import hookimpl

if TYPE_CHECKING:
    from tiercache.hookspecs import CodecRegistrar

__all__ = ["tiercache_register_codecs"]


@hookimpl
def tiercache_register_codecs(register: CodecRegistrar) -> None:
    """Register the codecs shipped with tiercache."""
    register("raw", "tiercache.serde.raw:RawCodec")
    register("fp8", "tiercache.serde.fp8:Fp8Codec")
    register("shuffle", "tiercache.serde.shuffle:ShuffleCodec")
    register("lz4", "tiercache.serde.lz4:Lz4Codec", extra="codecs")
    register("zstd", "tiercache.serde.zstd:ZstdCodec", extra="codecs")
    register("aesgcm", "tiercache.serde.aesgcm:AesGcmCodec", extra="codecs")
