"""The codec conformance kit on every built-in codec (fp8, shuffle, lz4, zstd, aesgcm) and standard chains."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.serde.aesgcm import AesGcmCodec
from tiercache.testing.codecs import CodecConformance

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
KEY_ENV = "TIERCACHE_TEST_AESGCM_KEY"
TEST_KEY = bytes(range(32))
FP8_DTYPES = ("bfloat16", "float16", "float32")
FP8_ERROR = 0.07  # documented bound: <= 2**-4 |x| + 2**-10 s + bf16 rounding, i.e. < 0.066 x group absmax


def fixed_nonce(n: int) -> bytes:
    """Test-only nonce source: the same nonce every frame (golden files), never in production."""
    return bytes(range(100, 100 + n))


def fixed_nonce_aes() -> AesGcmCodec:
    return AesGcmCodec(TEST_KEY, key_env=KEY_ENV, nonce_source=fixed_nonce)


@pytest.fixture(autouse=True, scope="module")
def _test_key_in_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, TEST_KEY.hex())
        yield


# ----- single codecs ----------------------------------------------------------------------------------------
class TestFp8Channel(CodecConformance):
    chain = ["fp8"]  # noqa: RUF012
    golden_dir = str(GOLDEN / "fp8")
    max_relative_error = FP8_ERROR
    dtypes = FP8_DTYPES


class TestFp8Token(CodecConformance):
    chain = [{"id": "fp8", "granularity": "token"}]  # noqa: RUF012
    golden_dir = str(GOLDEN / "fp8_token")
    max_relative_error = FP8_ERROR
    dtypes = FP8_DTYPES


class TestShuffle(CodecConformance):
    chain = ["raw", "shuffle"]  # noqa: RUF012
    golden_dir = str(GOLDEN / "raw_shuffle")


class TestShuffleFixedItemsize(CodecConformance):
    chain = ["raw", {"id": "shuffle", "itemsize": 4}]  # noqa: RUF012


class TestLz4(CodecConformance):
    chain = ["raw", "lz4"]  # noqa: RUF012
    golden_dir = str(GOLDEN / "raw_lz4")


class TestZstd(CodecConformance):
    chain = ["raw", {"id": "zstd", "level": 3}]  # noqa: RUF012
    golden_dir = str(GOLDEN / "raw_zstd")


class TestAesGcmFixedNonce(CodecConformance):
    chain = ["raw", fixed_nonce_aes()]  # noqa: RUF012
    golden_dir = str(GOLDEN / "raw_aesgcm")


class TestAesGcmFromConfig(CodecConformance):
    chain = ["raw", {"id": "aesgcm", "key_env": KEY_ENV}]  # noqa: RUF012
    deterministic = False


# ----- chains -----------------------------------------------------------------------------------------------
class TestFp8ShuffleZstd(CodecConformance):
    chain = ["fp8", "shuffle", "zstd"]  # noqa: RUF012
    golden_dir = str(GOLDEN / "fp8_shuffle_zstd")
    max_relative_error = FP8_ERROR
    dtypes = FP8_DTYPES


class TestRawShuffleLz4(CodecConformance):
    chain = ["raw", "shuffle", "lz4"]  # noqa: RUF012
    golden_dir = str(GOLDEN / "raw_shuffle_lz4")


class TestRawZstdAesGcm(CodecConformance):
    chain = ["raw", "zstd", {"id": "aesgcm", "key_env": KEY_ENV}]  # noqa: RUF012
    golden_dir = str(GOLDEN / "raw_zstd_aesgcm")
    deterministic = False  # random nonces: the stored frames are only decoded


class TestFp8ShuffleZstdAesGcm(CodecConformance):
    chain = ["fp8", "shuffle", "zstd", fixed_nonce_aes()]  # noqa: RUF012
    golden_dir = str(GOLDEN / "fp8_shuffle_zstd_aesgcm")
    max_relative_error = FP8_ERROR
    dtypes = FP8_DTYPES
