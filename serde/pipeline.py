"""CodecPipeline: one array→bytes codec then bytes→bytes codecs, producing and checking whole frames."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, overload

from tiercache.buffers import as_readable_bytes, as_writable_bytes
from tiercache.errors import ConfigError, FrameError, PluginError
from tiercache.serde._codec import Codec, CodecContext, Stage
from tiercache.serde.frame import (
    FIXED_SIZE,
    TRAILER_SIZE,
    FrameHeader,
    key_fingerprint,
    pack_static_header,
    payload_checksum,
    read_header,
    seal_header_into,
)
from tiercache.spec import dtype_name

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec

__all__ = ["ChainEntry", "CodecPipeline", "build_pipeline", "encrypting_codecs"]

ChainEntry = str | Mapping[str, object] | Codec
"""A codec id, a ``{"id": ..., **options}`` dict, or a ready codec instance."""


def _codec_class(codec_id: str) -> type[Codec] | None:
    """The class registered as ``codec_id`` (None if unknown); ConfigError if it cannot be imported."""
    from tiercache.registry import get_registry

    registry = get_registry()
    if codec_id not in registry.codec_ids():
        return None
    try:
        return registry.codec_class(codec_id)
    except PluginError as exc:
        raise ConfigError(f"codec {codec_id!r} cannot be loaded: {exc}") from exc


@overload
def build_pipeline(
    chain: Sequence[ChainEntry], *, validate_only: Literal[False] = False
) -> CodecPipeline: ...
@overload
def build_pipeline(chain: Sequence[ChainEntry], *, validate_only: Literal[True]) -> None: ...
def build_pipeline(chain: Sequence[ChainEntry], *, validate_only: bool = False) -> CodecPipeline | None:
    """Build a pipeline from codec ids / option dicts / codec instances; ConfigError if the chain is invalid.

    ``validate_only`` checks ids, options and stage order without building codecs (no secrets are read).
    """
    if isinstance(chain, str | bytes) or not isinstance(chain, Sequence):
        raise ConfigError(f"codec chain must be a list of codec ids or dicts, got {chain!r}")
    entries: list[tuple[str, Mapping[str, object]] | Codec] = []
    for entry in chain:
        if isinstance(entry, Codec):
            entries.append(entry)
        elif isinstance(entry, str):
            entries.append((entry, {"id": entry}))
        elif isinstance(entry, Mapping):
            codec_id = entry.get("id")
            if not isinstance(codec_id, str):
                raise ConfigError(f"codec entry {dict(entry)!r} needs a string 'id'")
            entries.append((codec_id, entry))
        else:
            raise ConfigError(f"codec entry must be an id or a dict with 'id', got {entry!r}")
    classes: dict[str, type[Codec] | None] = {
        e[0]: _codec_class(e[0]) for e in entries if not isinstance(e, Codec)
    }
    unknown = [cid for cid, cls in classes.items() if cls is None]
    if unknown:
        raise ConfigError(f"unknown codec id(s): {', '.join(repr(u) for u in unknown)}")
    resolved: list[tuple[type[Codec], Mapping[str, object]] | Codec] = []
    for e in entries:
        if isinstance(e, Codec):
            resolved.append(e)
        else:
            cls = classes[e[0]]
            assert cls is not None
            resolved.append((cls, e[1]))
    if validate_only:
        _check_order([r if isinstance(r, Codec) else r[0] for r in resolved])
        for r in resolved:
            if not isinstance(r, Codec):
                r[0].validate_config(r[1])
        return None
    return CodecPipeline([r if isinstance(r, Codec) else r[0].from_config(r[1]) for r in resolved])


def encrypting_codecs(chain: Sequence[ChainEntry]) -> list[str]:
    """Ids of the codecs of ``chain`` that encrypt (empty: stored in the clear); reads no secret."""
    ids = [
        e.codec_id if isinstance(e, Codec) else e if isinstance(e, str) else str(e.get("id")) for e in chain
    ]
    return [cid for cid in ids if getattr(_codec_class(cid), "encrypts", False)]


def _check_order(codecs: Sequence[Codec | type[Codec]]) -> None:
    """ConfigError unless ``codecs`` = one array-to-bytes codec, then bytes-to-bytes (must_be_last last)."""
    if not codecs:
        raise ConfigError("codec chain is empty: it needs one array-to-bytes codec (e.g. 'raw') first")
    if codecs[0].stage is not Stage.ARRAY_TO_BYTES:
        raise ConfigError(f"codec chain must start with an array-to-bytes codec, not {codecs[0].codec_id!r}")
    extra = [c.codec_id for c in codecs[1:] if c.stage is not Stage.BYTES_TO_BYTES]
    if extra:
        raise ConfigError(f"codec chain has more than one array-to-bytes codec: {', '.join(extra)}")
    early = [c.codec_id for c in codecs[:-1] if c.must_be_last]
    if early:
        raise ConfigError(f"codec(s) {', '.join(early)} must be last in the chain")
    for c in codecs:
        try:
            c.codec_id.encode("ascii")
        except UnicodeEncodeError:
            raise ConfigError(f"codec id {c.codec_id!r} is not ASCII") from None


_SCRATCH = threading.local()


def _scratch(slot: int, size: int) -> memoryview:
    """A reusable per-thread buffer of at least ``size`` bytes for intermediate codec stages.

    Two slots ping-pong between consecutive stages. Fresh allocations of large buffers cost page faults (about
    0.5 GB/s here), so buffers grow and stay; a buffer is replaced, never resized, so older views stay valid.
    """
    buffers: list[bytearray] | None = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = [bytearray(), bytearray()]
        _SCRATCH.buffers = buffers
    if len(buffers[slot]) < size:
        buffers[slot] = bytearray(size)
    return memoryview(buffers[slot])[:size]


class CodecPipeline:
    """Encodes KV arrays into frames and decodes frames back; every decoding failure is a FrameError."""

    def __init__(self, codecs: Sequence[Codec]) -> None:
        self._codecs = tuple(codecs)
        _check_order(self._codecs)
        self._chain = tuple(c.codec_id for c in self._codecs)
        self._params = tuple(bytes(c.header_params()) for c in self._codecs)
        entries = sum(1 + len(cid) + 2 + len(p) for cid, p in zip(self._chain, self._params, strict=True))
        self._header_len = FIXED_SIZE + entries + TRAILER_SIZE

    # ----- description ----------------------------------------------------------------------------------
    @property
    def codecs(self) -> tuple[Codec, ...]:
        """The codecs in encode order."""
        return self._codecs

    @property
    def chain(self) -> tuple[str, ...]:
        """The codec ids in encode order (as stored in frames)."""
        return self._chain

    @property
    def lossless(self) -> bool:
        """True when decode(encode(x)) == x bit for bit."""
        return all(c.lossless for c in self._codecs)

    def get_config(self) -> list[dict[str, object]]:
        """The chain as ``build_pipeline`` accepts it (no secrets)."""
        return [c.get_config() for c in self._codecs]

    def __repr__(self) -> str:
        return f"CodecPipeline({list(self._codecs)!r})"

    def bounds(self, spec: KVSpec) -> list[int]:
        """Upper bounds of each stage's output, preceded by ``spec.nbytes`` (len(codecs) + 1 entries)."""
        sizes = [spec.nbytes]
        for c in self._codecs:
            sizes.append(c.max_encoded_size(sizes[-1], spec))
        return sizes

    def itemsizes(self, spec: KVSpec) -> list[int]:
        """Element width of each stage's input (``CodecContext.itemsize``), ``len(codecs)`` entries."""
        widths = [spec.itemsize]
        for c in self._codecs[:-1]:
            widths.append(c.output_itemsize(spec, widths[-1]))
        return widths

    def max_frame_size(self, spec: KVSpec) -> int:
        """An upper bound of the size of any frame this pipeline writes for ``spec``."""
        return self._header_len + self.bounds(spec)[-1]

    def static_header(self, spec: KVSpec, key: str) -> bytes:
        """The static header (codec AAD) of frames of ``spec`` under ``key``."""
        return pack_static_header(spec, list(zip(self._chain, self._params, strict=True)), key)

    # ----- encode ---------------------------------------------------------------------------------------
    def encode(self, array: object, spec: KVSpec, key: str) -> bytearray:
        """A whole frame holding ``array`` (tensor, ndarray or bytes of ``spec.nbytes``) under ``key``."""
        frame = bytearray(self.max_frame_size(spec))
        n = self._encode_to(array, spec, key, frame)
        if n < len(frame):
            try:
                del frame[n:]
            except BufferError:  # a codec kept a view of the buffer: copy instead
                return frame[:n]
        return frame

    def encode_into(self, array: object, spec: KVSpec, key: str, dst: object) -> int:
        """Write a whole frame into ``dst`` (at least ``max_frame_size(spec)`` bytes); return its length."""
        out = as_writable_bytes(dst)
        need = self.max_frame_size(spec)
        if len(out) < need:
            raise ValueError(f"destination of {len(out)} bytes is smaller than max_frame_size {need}")
        return self._encode_to(array, spec, key, out)

    def encode_stage_output(self, data: object, spec: KVSpec, key: str) -> bytearray:
        """The frame ``encode`` would write for an array whose first (array-to-bytes) codec produced ``data``
        (its exact output, e.g. an fp8 L1's payload): only the later codecs run, so the frame is identical
        to ``encode(array, ...)`` (for codecs without random nonces, byte for byte)."""
        src = as_readable_bytes(data)
        frame = bytearray(self.max_frame_size(spec))
        n = self._encode_to(src, spec, key, frame, first=1)
        del frame[n:]
        return frame

    def decode_stage_input(
        self,
        frame: object,
        key: str,
        dst: object,
        expected_spec: KVSpec | None = None,
        *,
        header: FrameHeader,
    ) -> int:
        """Run every codec but the first on ``frame`` (checked as ``decode_into`` checks it; ``header`` is
        ``read_header(frame)``) and write what the first codec would decode into ``dst`` (e.g. an fp8 L1's
        payload); returns its length. FrameError on any fault, and when ``dst`` is not exactly that long."""
        out = as_writable_bytes(dst)
        mv = self._frame_view(frame)
        header = self._verify(mv, key, expected_spec, header)
        return self._decode_payload(mv, header, key, out, last=1)

    def _encode_to(
        self, array: object, spec: KVSpec, key: str, out: bytearray | memoryview, first: int = 0
    ) -> int:
        src = self._source(array, spec) if first == 0 else as_readable_bytes(array)
        static = self.static_header(spec, key)
        header_len = len(static) + TRAILER_SIZE
        assert header_len == self._header_len
        bounds = self.bounds(spec)
        ctx = CodecContext(key=key, aad=static)
        with memoryview(out) as mv:
            mv[: len(static)] = static
            payload = mv[header_len : header_len + bounds[-1]]
            n = self._encode_payload(src, payload, spec, ctx, bounds, first)
            seal_header_into(mv, len(static), n, payload_checksum(payload[:n]))
            payload.release()
        return header_len + n

    def _encode_payload(
        self,
        src: memoryview,
        out: memoryview,
        spec: KVSpec,
        ctx: CodecContext,
        bounds: list[int],
        first: int = 0,
    ) -> int:
        """Run codecs ``first..`` on ``src`` (codec ``first - 1``'s output, or the array) into ``out``."""
        data = src
        n = len(src)
        last = len(self._codecs) - 1
        widths = self.itemsizes(spec)
        if first > 0 and n > bounds[first]:
            raise ValueError(
                f"{n} bytes of codec {self._chain[first - 1]!r} output, over its bound {bounds[first]}"
            )
        if first > last:
            out[:n] = data
            return n
        for i in range(first, last + 1):
            codec = self._codecs[i]
            dst = out if i == last else _scratch(i % 2, bounds[i + 1])
            n = codec.encode_into(data, dst, spec, dataclasses.replace(ctx, itemsize=widths[i]))
            if not 0 <= n <= bounds[i + 1]:
                raise RuntimeError(
                    f"codec {codec.codec_id!r} wrote {n} bytes, over its bound {bounds[i + 1]}"
                )
            data = dst[:n]
        return n

    @staticmethod
    def _source(array: object, spec: KVSpec) -> memoryview:
        dtype = getattr(array, "dtype", None)
        if dtype is not None and str(dtype).removeprefix("torch.") != "uint8":
            try:
                name = dtype_name(dtype)
            except ValueError:
                name = str(dtype)
            if name != spec.dtype:
                raise ValueError(f"array dtype {name} does not match spec dtype {spec.dtype}")
        src = as_readable_bytes(array)
        if len(src) != spec.nbytes:
            raise ValueError(f"array has {len(src)} bytes, spec {spec} needs {spec.nbytes}")
        return src

    # ----- decode ---------------------------------------------------------------------------------------
    def check_frame(self, frame: object, key: str, expected_spec: KVSpec | None = None) -> FrameHeader:
        """Verify everything but the codecs' own checks (length, key, chain, spec, payload checksum)."""
        return self._verify(self._frame_view(frame), key, expected_spec)

    def decode(
        self, frame: object, key: str, expected_spec: KVSpec | None = None
    ) -> tuple[torch.Tensor, KVSpec]:
        """The KV tensor (spec.shape, spec.dtype) held by ``frame`` and its spec; FrameError on any fault."""
        import torch

        mv = self._frame_view(frame)
        header = self._verify(mv, key, expected_spec)
        spec = header.spec
        tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        self._decode_payload(mv, header, key, as_writable_bytes(tensor))
        return tensor, spec

    def decode_into(
        self,
        frame: object,
        key: str,
        dst: object,
        expected_spec: KVSpec | None = None,
        *,
        header: FrameHeader | None = None,
    ) -> KVSpec:
        """Decode ``frame`` into ``dst`` (exactly ``spec.nbytes`` writable bytes); return the frame's spec.

        ``header``: ``read_header(frame)`` where the caller already parsed it (it is not parsed again).
        FrameError on any fault (dst's content is then unspecified); ValueError if dst is not writable.
        """
        out = as_writable_bytes(dst)
        mv = self._frame_view(frame)
        header = self._verify(mv, key, expected_spec, header)
        if len(out) != header.spec.nbytes:
            raise FrameError(f"destination has {len(out)} bytes, the frame's array has {header.spec.nbytes}")
        self._decode_payload(mv, header, key, out)
        return header.spec

    @staticmethod
    def _frame_view(frame: object) -> memoryview:
        try:
            return as_readable_bytes(frame)
        except TypeError as exc:
            raise FrameError(f"not a frame: {exc}") from None

    def _verify(
        self, mv: memoryview, key: str, expected_spec: KVSpec | None, header: FrameHeader | None = None
    ) -> FrameHeader:
        if header is None:
            header = read_header(mv)
        if len(mv) != header.frame_len:
            raise FrameError(f"frame is {len(mv)} bytes, its header describes {header.frame_len}")
        if header.key_fingerprint != key_fingerprint(key):
            raise FrameError("frame was written under another key")
        if header.chain != self._chain or header.chain_params != self._params:
            raise FrameError(f"frame codec chain {list(header.chain)} does not match {list(self._chain)}")
        if expected_spec is not None and header.spec != expected_spec:
            raise FrameError(f"frame holds {header.spec}, expected {expected_spec}")
        if header.payload_len > self.bounds(header.spec)[-1]:
            raise FrameError(f"payload of {header.payload_len} bytes exceeds the chain's bound")
        if payload_checksum(mv[header.header_len :]) != header.checksum:
            raise FrameError("frame payload checksum mismatch")
        return header

    def _decode_payload(
        self, mv: memoryview, header: FrameHeader, key: str, dst: memoryview, last: int = 0
    ) -> int:
        """Decode the payload into ``dst``: the array (``last`` 0), or what codec ``last - 1`` wrote (then
        ``dst`` must be exactly that long); returns the bytes written."""
        spec = header.spec
        ctx = CodecContext(key=key, aad=bytes(mv[: header.static_len]))
        bounds = self.bounds(spec)
        widths = self.itemsizes(spec)
        data = mv[header.header_len :]
        codec = self._codecs[-1]
        try:
            for i in range(len(self._codecs) - 1, max(last, 1) - 1, -1):
                codec = self._codecs[i]
                scratch = _scratch(i % 2, bounds[i])
                n = codec.decode_into(data, scratch, spec, dataclasses.replace(ctx, itemsize=widths[i]))
                if not 0 <= n <= bounds[i]:
                    raise FrameError(
                        f"codec {codec.codec_id!r} decoded {n} bytes, over its bound {bounds[i]}"
                    )
                data = scratch[:n]
            if last > 0:  # stop before codec ``last``: its input, as it is
                if len(data) != len(dst):
                    what = self._chain[last - 1]
                    raise FrameError(f"the frame's {what!r} output is {len(data)} bytes, not {len(dst)}")
                dst[:] = data
                return len(data)
            codec = self._codecs[0]
            n = codec.decode_into(data, dst, spec, dataclasses.replace(ctx, itemsize=widths[0]))
        except FrameError:
            raise
        except Exception as exc:
            raise FrameError(f"codec {codec.codec_id!r} failed to decode the frame: {exc}") from exc
        if n != spec.nbytes:
            raise FrameError(f"codec {codec.codec_id!r} decoded {n} bytes, the array has {spec.nbytes}")
        return n
