"""The zstd codec: Zstandard compression, stored raw when it saves less than 1/64 (BYTES_TO_BYTES, lossless).

Output: one flag byte, then

- flag 0 (stored): the input bytes unchanged;
- flag 1 (zstd): one zstd frame (content size included; made with the dictionary when one is configured).

Options: ``level`` (zstd level, -7..22, default 1: on byte-split bf16 KV zstd-1 compresses as well as zstd-3,
at twice the speed), ``threads`` (zstd worker threads, 0 = in the calling thread), and an optional dictionary:
``dict_path`` (a file made by ``zstd --train``) or ``dict_env`` (an environment variable holding such a path).
The dictionary is read when the pipeline is built; its fingerprint is stored in the frame's chain
params (4 bytes of its SHA-256), so a frame written with another dictionary is a miss.
Needs ``zstandard`` (``tiercache[codecs]``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import zstandard

from tiercache.errors import ConfigError
from tiercache.serde._codec import Codec, CodecContext, Stage, int_option, str_option
from tiercache.serde._stored import FLAG_COMPRESSED, FLAG_STORED, read_stored, worth_compressing, write_stored

if TYPE_CHECKING:
    from typing import Self

    from tiercache.spec import KVSpec

__all__ = ["FLAG_COMPRESSED", "FLAG_STORED", "ZstdCodec"]

_MIN_LEVEL, _MAX_LEVEL = -7, 22


class ZstdCodec(Codec):
    """Zstandard compression with a stored fallback and an optional dictionary; see the module doc."""

    codec_id: ClassVar[str] = "zstd"
    stage: ClassVar[Stage] = Stage.BYTES_TO_BYTES
    lossless: ClassVar[bool] = True
    config_options: ClassVar[tuple[str, ...]] = ("level", "threads", "dict_path", "dict_env")

    def __init__(
        self,
        level: int = 1,
        *,
        threads: int = 0,
        dictionary: bytes | None = None,
        dict_path: str | None = None,
        dict_env: str | None = None,
    ) -> None:
        """``dictionary``: the dictionary bytes (``dict_path``/``dict_env`` record where they came from)."""
        self.level = level
        self.threads = threads
        self.dict_path = dict_path
        self.dict_env = dict_env
        self._dict = zstandard.ZstdCompressionDict(dictionary) if dictionary else None
        self._zstd_dict_id = self._dict.dict_id() if self._dict is not None else 0
        self.dict_fingerprint = hashlib.sha256(dictionary).digest()[:4] if dictionary else b""
        """First 4 bytes of SHA-256 of the dictionary (raw-content dictionaries all have zstd id 0)."""
        self._local = threading.local()

    # ----- config -----
    @classmethod
    def valid_options(cls, config: Mapping[str, object]) -> dict[str, object]:
        """The options, names and values checked; the dictionary file is not read."""
        options = cls.check_options(config)
        int_option("zstd", "level", options.get("level", 1), _MIN_LEVEL, _MAX_LEVEL)
        int_option("zstd", "threads", options.get("threads", 0), 0, 256)
        path, env = (
            str_option("zstd", "dict_path", options.get("dict_path")),
            str_option("zstd", "dict_env", options.get("dict_env")),
        )
        if path is not None and env is not None:
            raise ConfigError("zstd: give dict_path or dict_env, not both")
        return options

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        """Build from ``{"id": "zstd", "level": 1, "dict_path": …}``; reads the dictionary."""
        options = cls.valid_options(config)
        path = str_option("zstd", "dict_path", options.get("dict_path"))
        env = str_option("zstd", "dict_env", options.get("dict_env"))
        source = path
        if env is not None:
            source = os.environ.get(env)
            if not source:
                raise ConfigError(f"zstd dict_env: environment variable {env} is not set")
        dictionary = None
        if source is not None:
            try:
                with open(source, "rb") as f:
                    dictionary = f.read()
            except OSError as exc:
                raise ConfigError(f"zstd dictionary {source!r} cannot be read: {exc}") from None
            if not dictionary:
                raise ConfigError(f"zstd dictionary {source!r} is empty")
        return cls(
            int_option("zstd", "level", options.get("level", 1), _MIN_LEVEL, _MAX_LEVEL),
            threads=int_option("zstd", "threads", options.get("threads", 0), 0, 256),
            dictionary=dictionary,
            dict_path=path,
            dict_env=env,
        )

    def get_config(self) -> dict[str, object]:
        """Level, threads and where the dictionary comes from (never its bytes)."""
        config: dict[str, object] = {"id": self.codec_id, "level": self.level, "threads": self.threads}
        if self.dict_path is not None:
            config["dict_path"] = self.dict_path
        if self.dict_env is not None:
            config["dict_env"] = self.dict_env
        return config

    def header_params(self) -> bytes:
        """Empty without a dictionary, else its 4-byte fingerprint (decoding needs the same dictionary)."""
        return self.dict_fingerprint

    # ----- per-thread contexts (zstd contexts are not thread-safe) -----
    def _compressor(self) -> zstandard.ZstdCompressor:
        c: zstandard.ZstdCompressor | None = getattr(self._local, "c", None)
        if c is None:
            c = zstandard.ZstdCompressor(
                level=self.level, dict_data=self._dict, threads=self.threads, write_content_size=True
            )
            self._local.c = c
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d: zstandard.ZstdDecompressor | None = getattr(self._local, "d", None)
        if d is None:
            d = zstandard.ZstdDecompressor(dict_data=self._dict)
            self._local.d = d
        return d

    # ----- encode / decode -----
    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """Input plus the flag byte (the compressed form is only kept when smaller)."""
        return nbytes + 1

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Compress into ``dst``, or store when the saving is below 1/64."""
        n = len(src)
        if n > 0:
            packed = self._compressor().compress(src)
            total = 1 + len(packed)
            if worth_compressing(total, n):
                dst[0] = FLAG_COMPRESSED
                dst[1:total] = packed
                return total
        return write_stored(src, dst)

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Decompress (or copy) into ``dst``; ValueError/ZstdError on a malformed payload."""
        stored = read_stored(src, dst, "zstd")
        if stored is not None:
            return stored
        body = src[1:]
        params = zstandard.get_frame_parameters(body)
        n = params.content_size
        if n == zstandard.CONTENTSIZE_UNKNOWN or n > len(dst):
            raise ValueError(f"zstd frame of content size {n} does not fit a {len(dst)}-byte destination")
        if params.dict_id != self._zstd_dict_id:
            raise ValueError(
                f"zstd frame needs dictionary {params.dict_id}, this codec has {self._zstd_dict_id}"
            )
        out = self._decompressor().decompress(body, max_output_size=n)
        if len(out) != n:
            raise ValueError(f"zstd frame decoded to {len(out)} bytes, expected {n}")
        dst[:n] = out
        return n
