"""Codec benchmark: throughput against the raw library call, ratio and fp8 error, on real KV and random data.

    .venv/bin/python -P benchmarks/codec_bench.py [--repeat 7] [--out benchmarks/results/codec_bench_cpu.json]

Inputs: the real-KV sample (tests/fixtures/kv_sample, bf16 [2, 4, 256, 256], 1 MiB; see make_kv_sample.py) and
random normal bf16 of the same shape. Every figure is the best of ``--repeat`` runs, codec and library call
interleaved in the same loop, so their ratio is meaningful on a shared machine (absolute GB/s are not).
GB/s count the stage's input bytes (encode) or output bytes (decode).
"relative_error" is ||x' - x||₂ / ||x||₂;
"max_error_over_absmax" is max|x' - x| / max|x|.
The measuring functions live in ``tiercache.cli.bench.codecs``
(``tiercache bench codecs`` runs them with plots).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
from pathlib import Path

import lz4.block
import numpy as np
import torch
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiercache.cli.bench.codecs import as_bytes, chain_result, stage_vs_library
from tiercache.cli.bench.report import print_json
from tiercache.serde import build_pipeline
from tiercache.serde.aesgcm import AesGcmCodec
from tiercache.serde.lz4 import Lz4Codec
from tiercache.serde.zstd import ZstdCodec
from tiercache.testing.codecs import load_kv_sample

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "tests" / "fixtures" / "kv_sample"
KEY = bytes(range(32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "codec_bench_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("TIERCACHE_BENCH_KEY", KEY.hex())
    real, spec = load_kv_sample(SAMPLE)
    real = real.clone()  # memory of its own (aligned), not the file's bytearray
    rng = np.random.default_rng(0)
    rand = torch.from_numpy(rng.standard_normal(spec.shape, dtype=np.float32)).to(torch.bfloat16)
    inputs = {"real_kv": real, "random_normal": rand}
    aes = AESGCM(KEY)
    nonce = bytes(12)
    z_c, z_d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    results: dict[str, object] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "lz4": lz4.library_version_string(),
            "zstd": zstandard.ZSTD_VERSION,
            "torch_threads": torch.get_num_threads(),
        },
        "inputs": {
            "real_kv": "tests/fixtures/kv_sample (trained tiny Llama-style model, see make_kv_sample.py)",
            "random_normal": "standard normal float32 -> bf16, same shape",
            "spec": str(spec),
            "bytes": spec.nbytes,
        },
        "repeat": args.repeat,
    }
    shuffle = build_pipeline(["raw", "shuffle"])
    for label, x in inputs.items():
        data = as_bytes(x)
        shuffled = bytes(shuffle.encode(x, spec, "k")[-(spec.nbytes + 1) :])
        fp8_bytes = bytes(build_pipeline(["fp8", "shuffle"]).encode(x, spec, "k"))
        stages = []
        for what, buf in (("raw_bf16", data), ("shuffled_bf16", shuffled), ("fp8_shuffled", fp8_bytes)):
            lib = [
                ("lz4", Lz4Codec(), lambda b: lz4.block.compress(b, store_size=False),
                 functools.partial(lz4.block.decompress, uncompressed_size=len(buf))),
                ("zstd", ZstdCodec(1), z_c.compress, z_d.decompress),
                ("aesgcm", AesGcmCodec(KEY), lambda b: aes.encrypt(nonce, b, b"aad"),
                 lambda b: aes.decrypt(nonce, b, b"aad")),
            ]  # fmt: skip
            for name, codec, enc, dec in lib:
                r = stage_vs_library(name, codec, enc, dec, buf, spec, args.repeat)
                stages.append({"input": what, **r})
        chains: list[list[object]] = [
            ["raw"],
            ["raw", "lz4"],
            ["raw", "zstd"],
            ["raw", "shuffle", "lz4"],
            ["raw", "shuffle", "zstd"],
            ["raw", "zstd", {"id": "aesgcm", "key_env": "TIERCACHE_BENCH_KEY"}],
            ["fp8"],
            [{"id": "fp8", "granularity": "token"}],
            ["fp8", "shuffle", "zstd"],
            [{"id": "fp8", "granularity": "token"}, "shuffle", "zstd"],
            ["fp8", "shuffle", {"id": "zstd", "level": 3}],
            ["fp8", "shuffle", "lz4"],
            ["fp8", "shuffle", "zstd", {"id": "aesgcm", "key_env": "TIERCACHE_BENCH_KEY"}],
        ]
        results[label] = {
            "stages_vs_library": stages,
            "chains": [chain_result(c, x, spec, args.repeat) for c in chains],
        }
    print_json(results, args.out)


if __name__ == "__main__":
    main()
