"""Codecs and frames: the Codec ABC, the versioned frame format and the codec pipeline (no torch import)."""

from __future__ import annotations

from tiercache.errors import FrameError
from tiercache.serde._codec import Codec, CodecContext, Stage
from tiercache.serde.frame import FrameHeader, read_header
from tiercache.serde.pipeline import CodecPipeline, build_pipeline, encrypting_codecs

__all__ = [
    "Codec",
    "CodecContext",
    "CodecPipeline",
    "FrameError",
    "FrameHeader",
    "Stage",
    "build_pipeline",
    "encrypting_codecs",
    "read_header",
]
