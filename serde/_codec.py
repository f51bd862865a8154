"""The Codec contract: one stage of a pipeline (array→bytes first, then bytes→bytes, encryption last)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tiercache.errors import ConfigError

if TYPE_CHECKING:
    from typing import Self

    from tiercache.spec import KVSpec

__all__ = ["Codec", "CodecContext", "Stage", "int_option", "str_option"]


def int_option(codec_id: str, name: str, value: object, lo: int, hi: int) -> int:
    """``value`` of the option ``name``: an integer in ``lo..hi`` (not a bool); ConfigError naming the codec
    and the option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{codec_id} {name} must be an integer {lo}..{hi}, not {value!r}")
    return value


def str_option(codec_id: str, name: str, value: object) -> str | None:
    """``value`` of the option ``name``: None or a non-empty string; ConfigError naming the codec and the
    option otherwise."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{codec_id} {name} must be a non-empty string, not {value!r}")
    return value


class Stage(enum.Enum):
    """Where a codec sits in a pipeline."""

    ARRAY_TO_BYTES = "array_to_bytes"
    """Turns the raw bytes of a KV array (spec.shape, spec.dtype) into bytes; exactly one, first."""
    BYTES_TO_BYTES = "bytes_to_bytes"
    """Turns bytes into bytes (compression, encryption); any number, after the array stage."""


@dataclass(frozen=True, slots=True)
class CodecContext:
    """Per-frame facts a codec may bind to: the object's key and the frame's static header bytes.

    ``aad`` is the part of the frame header that does not depend on the payload (``tiercache.serde.frame``);
    an AEAD codec authenticates ``key`` and ``aad`` so a payload cannot be moved under another key or header.
    """

    key: str
    aad: bytes
    itemsize: int = field(default=0, compare=False)
    """Element width in bytes of the data this stage receives on encode (and must reproduce on decode), as
    threaded by the pipeline through ``Codec.output_itemsize``; 0 = unknown. A hint for layout-aware codecs
    (``shuffle``), not part of the context's identity (excluded from ``==``)."""


class Codec(ABC):
    """One stage of a codec pipeline; instances are immutable and safe to share between threads.

    ``encode_into``/``decode_into`` write into caller-owned buffers and return the number of bytes written.
    For ARRAY_TO_BYTES codecs, ``src`` on encode is the C-contiguous raw bytes of the array (exactly
    ``spec.nbytes``) and ``dst`` on decode is exactly ``spec.nbytes`` writable bytes of the destination array.
    For BYTES_TO_BYTES codecs, ``dst`` on decode holds at least the previous stage's ``max_encoded_size``.
    On encode, ``dst`` holds at least ``max_encoded_size(len(src), spec)`` bytes.
    """

    codec_id: ClassVar[str]
    """Stable id stored in frames and used in configs ("raw", "fp8", "lz4", "zstd", "aesgcm")."""
    stage: ClassVar[Stage]
    lossless: ClassVar[bool]
    must_be_last: ClassVar[bool] = False
    """True for codecs that must end the chain (encryption: nothing may follow an AEAD)."""
    encrypts: ClassVar[bool] = False
    """True for codecs that encrypt (``tiercache check`` and the demo show such tiers as encrypted)."""
    config_options: ClassVar[tuple[str, ...]] = ()
    """Option names ``from_config`` accepts besides "id"."""

    @abstractmethod
    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """A guaranteed upper bound of the encoded size of ``nbytes`` input bytes of an object ``spec``."""

    @abstractmethod
    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Encode ``src`` into the start of ``dst``; return the number of bytes written."""

    @abstractmethod
    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Decode ``src`` into the start of ``dst``; return the bytes written; raise on bad input."""

    def output_itemsize(self, spec: KVSpec, itemsize: int) -> int:
        """Element width in bytes of this stage's output, given its input's (``itemsize``).

        The pipeline threads it from stage to stage into ``CodecContext.itemsize``. Default: an array-to-bytes
        codec emits the array's elements (``spec.itemsize``); a bytes-to-bytes codec emits opaque bytes (1).
        """
        return spec.itemsize if self.stage is Stage.ARRAY_TO_BYTES else 1

    def header_params(self) -> bytes:
        """Small parameters that affect decoding, stored in the frame's chain entry (at most 65535 bytes)."""
        return b""

    def get_config(self) -> dict[str, object]:
        """JSON-compatible options that rebuild this codec (``from_config``); includes "id", no secrets."""
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        """Build the codec from ``get_config()``-style options; unknown options raise ConfigError."""
        cls.check_options(config)
        return cls()

    @classmethod
    def validate_config(cls, config: Mapping[str, object]) -> None:
        """ConfigError if ``config`` is invalid, without building the codec (no secrets are read)."""
        cls.valid_options(config)

    @classmethod
    def valid_options(cls, config: Mapping[str, object]) -> dict[str, object]:
        """``check_options`` plus the codec's own checks of the values, reading no file, secret or environment
        variable (what ``validate_config`` checks; a codec with value rules overrides it for both)."""
        return cls.check_options(config)

    @classmethod
    def check_options(
        cls, config: Mapping[str, object], allowed: Collection[str] | None = None
    ) -> dict[str, object]:
        """The options of ``config`` without "id"; ConfigError naming any unknown option or a foreign id.

        ``allowed`` defaults to ``config_options``.
        """
        if allowed is None:
            allowed = cls.config_options
        codec_id = config.get("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise ConfigError(f"codec config for {codec_id!r} given to codec {cls.codec_id!r}")
        options = {k: v for k, v in config.items() if k != "id"}
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            known = ", ".join(sorted(allowed)) or "none"
            raise ConfigError(
                f"unknown option(s) for codec {cls.codec_id!r}: {', '.join(unknown)} (known: {known})"
            )
        return options

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({options})"
