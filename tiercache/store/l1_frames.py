"""Frames to and from L1 objects, whatever the L1 holds (``L1Cache.codec``).

A raw L1 holds the KV's bytes: a tier's pipeline encodes them whole and decodes frames back into them. An fp8
L1 holds ``Fp8Codec("channel")``'s payload of the KV, which is exactly what the first codec of an
fp8-first chain writes: a store runs only the later codecs on it (the frame is the one ``encode`` would
write from the original KV, without quantizing twice), and a load stops before the fp8 codec (the payload
goes into L1 as it is; its scales are checked, as the codec's decode would). Other chains under an fp8 L1
are refused (``check_tier``, and ``config.check_l1_codec`` when a config loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.errors import FrameError

if TYPE_CHECKING:
    from tiercache.serde import CodecPipeline
    from tiercache.serde.frame import FrameHeader
    from tiercache.spec import KVSpec
    from tiercache.store._frames import FrameBuffers
    from tiercache.store.l1 import KVObject

__all__ = ["check_tier", "decode_into_l1", "encode_from_l1", "l1_codec"]


def l1_codec(l1: object) -> str:
    """What ``l1`` holds (``"raw"`` for an L1 without a codec, e.g. the shared L1 client)."""
    return str(getattr(l1, "codec", "raw"))


def _fp8_first(pipeline: CodecPipeline) -> bool:
    from tiercache.serde.fp8 import Fp8Codec

    first = pipeline.codecs[0]
    return isinstance(first, Fp8Codec) and first.granularity == "channel"


def check_tier(codec: str, name: str, pipeline: CodecPipeline) -> None:
    """``ValueError`` when tier ``name``'s chain cannot store an L1 of ``codec`` as it is."""
    if codec == "fp8" and not _fp8_first(pipeline):
        raise ValueError(
            f'an fp8 L1 needs every tier\'s chain to start with "fp8" (channel granularity); tier {name!r} '
            f"has {list(pipeline.chain)}"
        )


def encode_from_l1(
    pipeline: CodecPipeline, obj: KVObject, codec: str, frames: FrameBuffers | None = None
) -> bytearray | memoryview:
    """The frame of L1 object ``obj`` under its key (for an fp8 L1, from its payload as it is); a raw L1's
    frame is encoded into a reused buffer of ``frames`` where given (a view of it is returned)."""
    if codec == "fp8":
        return pipeline.encode_stage_output(obj.buffer(), obj.spec, obj.key)
    if frames is None:
        return pipeline.encode(obj.buffer(), obj.spec, obj.key)
    buf = frames.take(pipeline.max_frame_size(obj.spec))
    return memoryview(buf)[: pipeline.encode_into(obj.buffer(), obj.spec, obj.key, buf)]


def decode_into_l1(
    pipeline: CodecPipeline,
    frame: object,
    obj: KVObject,
    codec: str,
    expected_spec: KVSpec,
    header: FrameHeader,
) -> None:
    """Decode ``frame`` into L1 object ``obj`` (for an fp8 L1: its checked fp8 payload); FrameError on any
    fault."""
    if codec != "fp8":
        pipeline.decode_into(frame, obj.key, obj.buffer(), expected_spec=expected_spec, header=header)
        return
    from tiercache.serde.fp8 import Fp8Codec

    dst = obj.buffer()
    pipeline.decode_stage_input(frame, obj.key, dst, expected_spec, header=header)
    first = pipeline.codecs[0]
    assert isinstance(first, Fp8Codec)
    try:
        first.check_payload(dst, expected_spec)
    except ValueError as exc:
        raise FrameError(f"codec 'fp8' failed to decode the frame: {exc}") from None
