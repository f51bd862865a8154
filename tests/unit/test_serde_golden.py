"""Golden frames freeze the on-wire format: byte-for-byte encoding, decoding, and a struct-level parse.

Regenerate (after a deliberate format change, with a version bump): ``TIERCACHE_REGEN_GOLDEN=1 pytest
tests/unit/test_serde_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import pytest
import xxhash

from tiercache.buffers import as_readable_bytes
from tiercache.serde import build_pipeline
from tiercache.spec import DTYPE_CODES, KVFormat
from tiercache.testing.codecs import check_golden, golden_array, golden_values, load_golden_cases

GOLDEN_RAW = Path(__file__).resolve().parent.parent / "golden" / "raw"


def test_raw_golden_frames() -> None:
    """Encodes the fixed inputs exactly as stored and decodes the stored frames (regenerates on request)."""
    check_golden(build_pipeline(["raw"]), GOLDEN_RAW)


def test_golden_spec_json_describes_the_inputs() -> None:
    doc = json.loads((GOLDEN_RAW / "spec.json").read_text())
    assert doc["chain"] == [{"id": "raw"}]
    names = {c["name"]: c for c in doc["cases"]}
    assert names["kv2ltd_bf16"]["spec"] == {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "bfloat16", "format": "KV_2LTD",
        "tokens": 3, "layer_start": 0, "layer_end": 2,
    }  # fmt: skip
    assert names["mla_fp16_layers1to3"]["spec"]["format"] == "KV_MLA"


def test_golden_values_formula() -> None:
    assert golden_values(4) == [(11 - 125) / 64, (48 - 125) / 64, (85 - 125) / 64, (122 - 125) / 64]


@pytest.mark.parametrize("case", load_golden_cases(GOLDEN_RAW), ids=lambda c: c.name)
def test_golden_layout_field_by_field(case: object) -> None:
    """Parse the stored frame with struct alone, independently of tiercache.serde.frame."""
    from tiercache.testing.codecs import GoldenCase

    assert isinstance(case, GoldenCase)
    spec = case.spec
    frame = (GOLDEN_RAW / case.file).read_bytes()
    magic, version, header_len, flags = struct.unpack_from("<4sHHH", frame, 0)
    assert (magic, version, flags) == (b"TCKV", 1, 0)
    assert header_len == 56 + (1 + 3 + 2) + 20 == 82
    fmt, dtype, checksum_kind, count, reserved = struct.unpack_from("<BBBBH", frame, 10)
    expected_fmt = 1 if spec.format is KVFormat.KV_2LTD else 2
    assert (fmt, dtype, checksum_kind, count, reserved) == (expected_fmt, DTYPE_CODES[spec.dtype], 1, 1, 0)
    dims = struct.unpack_from("<6I", frame, 16)
    assert dims == (
        spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.tokens, spec.layer_start, spec.layer_end,
    )  # fmt: skip
    raw_len, fingerprint = struct.unpack_from("<QQ", frame, 40)
    assert raw_len == spec.nbytes
    assert fingerprint == struct.unpack("<Q", hashlib.sha256(case.key.encode()).digest()[:8])[0]
    id_len = frame[56]
    assert frame[57 : 57 + id_len] == b"raw"
    (params_len,) = struct.unpack_from("<H", frame, 57 + id_len)
    assert params_len == 0
    tail = 57 + id_len + 2 + params_len
    assert tail == header_len - 20
    payload_len, checksum, crc = struct.unpack_from("<QQI", frame, tail)
    payload = frame[header_len:]
    assert payload_len == len(payload) == spec.nbytes
    assert checksum == xxhash.xxh3_64_intdigest(payload)
    assert crc == zlib.crc32(frame[: header_len - 4])
    assert payload == bytes(as_readable_bytes(golden_array(spec)))
