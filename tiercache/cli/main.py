"""The ``tiercache`` command: demo, bench, plugins, check, inspect (verifies frames), conformance, --version.

Every failure is one clear line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercache.errors import TiercacheError

if TYPE_CHECKING:
    from tiercache.config import Config, TierConfig

__all__ = ["main"]

EXIT_FAIL = 1  # a check ran and something failed
EXIT_USAGE = 2  # bad input: config, arguments, files


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ----- plugins ---------------------------------------------------------------------------------------------
def _cmd_plugins(args: argparse.Namespace) -> int:
    from tiercache.registry import get_registry

    registry = get_registry()
    rows = [
        {
            "kind": r.kind,
            "name": r.name,
            "target": r.target,
            "distribution": r.distribution,
            "alias_of": r.alias_of,
            "extra": r.extra,
        }
        for r in [*registry.adapters(), *registry.codecs()]
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for kind in ("adapter", "codec"):
        print(f"{kind}s:")
        for row in rows:
            if row["kind"] != kind:
                continue
            alias = f" (alias of {row['alias_of']})" if row["alias_of"] else ""
            extra = f"  [extra: {row['extra']}]" if row["extra"] else ""
            print(f"  {row['name']:<14} {row['target']:<48} from {row['distribution']}{alias}{extra}")
    return 0


# ----- check -----------------------------------------------------------------------------------------------
async def _check_tier(tier: TierConfig, deadline_s: float) -> dict[str, Any]:
    import numpy as np

    from tiercache._open import open_adapter
    from tiercache.config import redact_text, redact_url
    from tiercache.serde import build_pipeline
    from tiercache.spec import KVSpec

    result: dict[str, Any] = {
        "tier": tier.name,
        "url": redact_url(tier.url),
        "codecs": [_codec_name(c) for c in tier.codecs],
    }
    started = time.perf_counter()
    adapter = None
    try:
        pipeline = build_pipeline(list(tier.codecs))
        adapter = await asyncio.wait_for(
            open_adapter(tier.url, adapter=tier.adapter, **tier.adapter_options()), deadline_s
        )
        result["adapter"] = f"{type(adapter).__module__}:{type(adapter).__qualname__}"
        describe = getattr(adapter, "describe", None)  # optional: e.g. nvme+slab reports its I/O mode
        if callable(describe):
            result["io"] = str(describe())
        spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens=16)
        payload = np.random.default_rng().integers(0, 1 << 16, spec.nbytes // 2, dtype=np.uint16)
        payload[payload & 0x7F80 == 0x7F80] &= 0x3FFF  # no NaN/inf bit patterns (lossy codecs compare values)
        key = f"tiercache-check.{os.getpid()}.{time.time_ns()}"
        frame = pipeline.encode(payload.tobytes(), spec, key)
        stored = await asyncio.wait_for(adapter.batched_put([key], [frame]), deadline_s)
        if not stored[0]:
            raise TiercacheError("probe put was refused")
        present = await asyncio.wait_for(adapter.batched_contains([key]), deadline_s)
        if not present[0]:
            raise TiercacheError("probe object not found after put")
        got = (await asyncio.wait_for(adapter.batched_get([key]), deadline_s))[0]
        if got is None:
            raise TiercacheError("probe get missed after put")
        out = bytearray(spec.nbytes)
        pipeline.decode_into(got, key, out, expected_spec=spec)
        lossless = all(getattr(c, "lossless", True) for c in pipeline.codecs)
        if lossless and bytes(out) != payload.tobytes():
            raise TiercacheError("probe read back different bytes")
        if adapter.capabilities.delete:
            await asyncio.wait_for(adapter.batched_delete([key]), deadline_s)
        result.update(ok=True, frame_bytes=len(frame), raw_bytes=spec.nbytes)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        result.update(ok=False, error=redact_text(error, tier.url))
    finally:
        if adapter is not None:
            try:
                await adapter.aclose()
            except Exception as exc:  # closing must not hide the verdict
                result.setdefault("close_error", redact_text(str(exc), tier.url))
        result["seconds"] = round(time.perf_counter() - started, 4)
    return result


def _codec_name(codec: object) -> str:
    return codec if isinstance(codec, str) else str(dict(codec).get("id"))  # type: ignore[call-overload]


async def _check_all(config: Config, deadline_s: float) -> list[dict[str, Any]]:
    from tiercache.serde import encrypting_codecs

    return [
        {**await _check_tier(tier, deadline_s), "encrypted": "+".join(encrypting_codecs(tier.codecs)) or None}
        for tier in config.tiers
    ]


def _cmd_check(args: argparse.Namespace) -> int:
    from tiercache.config import load_config

    config = load_config(args.config)
    results = asyncio.run(_check_all(config, args.deadline_s))
    ok = all(r["ok"] for r in results)
    if args.json:
        print(
            json.dumps(
                {
                    "config": str(args.config),
                    "ok": ok,
                    "l1_capacity": config.l1.capacity,
                    "chunk_size": config.chunk_size,
                    "tiers": results,
                },
                indent=2,
            )
        )
    else:
        print(
            f"config {args.config}: chunk_size={config.chunk_size}, "
            f"save_unfull_chunk={config.save_unfull_chunk}"
        )
        print(f"  L1      host memory {_size(config.l1.capacity):>12}  OK")
        for r in results:
            status = "OK" if r["ok"] else f"FAIL  {r['error']}"
            chain = "+".join(r["codecs"])
            sealed = f"encrypted ({r['encrypted']})" if r["encrypted"] else "not encrypted"
            print(
                f"  {r['tier']:<7} {r['url']:<44} [{chain}] {sealed}  {r['seconds'] * 1000:7.1f} ms  {status}"
            )
            if r.get("io"):
                print(f"          io: {r['io']}")
        if not config.tiers:
            print("  (no L2 tiers configured)")
    return 0 if ok else EXIT_FAIL


# ----- inspect ---------------------------------------------------------------------------------------------
def _codec_params(header: Any, frame: bytes) -> dict[str, Any]:
    """Chain params as hex (non-empty only) and, for an aesgcm frame, its key id (payload bytes 1..4)."""
    out: dict[str, Any] = {
        f"{cid}_params": p.hex() for cid, p in zip(header.chain, header.chain_params, strict=True) if p
    }
    payload = frame[header.header_len :]
    if header.chain and header.chain[-1] == "aesgcm" and len(payload) >= 5:
        out["aesgcm_key_id"] = payload[1:5][::-1].hex()  # u32 little-endian, shown as 8 hex digits
    return out


def _header_dict(header: Any, frame: bytes = b"") -> dict[str, Any]:
    spec = header.spec
    return {
        "format_version": header.version,
        "chain": list(header.chain),
        "kv_format": spec.format.name,
        "dtype": spec.dtype,
        "num_layers": spec.num_layers,
        "layer_range": [spec.layer_start, spec.layer_end],
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "tokens": spec.tokens,
        "raw_bytes": header.raw_len,
        "payload_bytes": header.payload_len,
        "header_bytes": header.header_len,
        "checksum": f"{header.checksum:016x}",
        "key_fingerprint": f"{header.key_fingerprint:016x}",
        **_codec_params(header, frame),
    }


async def _fetch_frames(config: Config, key: str, deadline_s: float) -> list[tuple[str, bytes]]:
    from tiercache._open import open_adapter

    found: list[tuple[str, bytes]] = []
    for tier in config.tiers:
        adapter = await asyncio.wait_for(
            open_adapter(tier.url, adapter=tier.adapter, **tier.adapter_options()), deadline_s
        )
        try:
            got = (await asyncio.wait_for(adapter.batched_get([key]), deadline_s))[0]
            if got is not None:
                found.append((tier.name, bytes(got)))
        finally:
            await adapter.aclose()
    return found


def _verify(header: Any, frame: bytes, key: str | None) -> list[str]:
    """What is wrong with ``frame`` beyond its header (whose crc ``read_header`` checked): its length, its
    payload checksum and, where the key is known, the key it is bound to. Empty when the frame is sound."""
    from tiercache.serde.frame import key_fingerprint, payload_checksum

    problems = []
    if len(frame) != header.frame_len:
        problems.append(f"frame is {len(frame)} bytes, its header says {header.frame_len}")
    else:
        got = payload_checksum(memoryview(frame)[header.header_len :])
        if got != header.checksum:
            problems.append(
                f"payload checksum mismatch: computed {got:016x}, header says {header.checksum:016x}"
            )
    if key is not None and key_fingerprint(key) != header.key_fingerprint:
        problems.append(f"frame is not bound to key {key!r} (key fingerprint mismatch)")
    return problems


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tiercache.serde import read_header

    target = args.target
    if Path(target).is_file():
        frames = [(target, Path(target).read_bytes())]
        key = args.key
    elif args.config:
        from tiercache.config import load_config

        frames = asyncio.run(_fetch_frames(load_config(args.config), target, args.deadline_s))
        if not frames:
            raise TiercacheError(f"key {target!r} is in none of the tiers of {args.config}")
        key = target
    else:
        raise TiercacheError(f"{target!r} is not a file; to look a key up in the tiers, pass --config FILE")
    results = []
    for where, frame in frames:
        header = read_header(frame)
        problems = _verify(header, frame, key)
        info = {"source": where, "frame_bytes": len(frame), **_header_dict(header, frame)}
        info.update(verified=not problems, problems=problems)
        results.append(info)
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        for info in results:
            for name, value in info.items():
                if name != "problems":
                    print(f"{name:>16}: {value}")
            for problem in info["problems"]:
                print(f"{'CORRUPT':>16}: {problem}")
            print()
    bad = [info for info in results if not info["verified"]]
    for info in bad:
        print(f"tiercache: corrupt frame in {info['source']}: {'; '.join(info['problems'])}", file=sys.stderr)
    return EXIT_FAIL if bad else 0


# ----- conformance -----------------------------------------------------------------------------------------
def _refuse_destructive_url(url: str) -> None:
    """The kit writes to a live store: never let its URL ask for a reformat (``format=true``)."""
    from urllib.parse import parse_qsl, urlsplit

    from tiercache.adapters.options import parse_bool

    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name == "format":
            try:
                destructive = parse_bool(value)
            except ValueError:
                destructive = True
            if destructive:
                raise TiercacheError(
                    "conformance never reformats a store: drop 'format=...' from the URL "
                    "(format it once, outside the kit, if that is what you want)"
                )


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import pytest
    except ImportError:
        raise TiercacheError("the conformance kit needs pytest: pip install 'tiercache[testing]'") from None
    from tiercache.config import check_url_secrets

    check_url_secrets(args.url, "conformance")
    _refuse_destructive_url(args.url)
    pytest_args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "tiercache.testing.url_suite",
        "--tiercache-url",
        args.url,
        *args.pytest_args,
    ]
    return int(pytest.main(pytest_args))


# ----- demo ------------------------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    from tiercache.cli.demo import run_demo

    return run_demo(args.config, json_path=args.json, show_metrics=args.metrics)


# ----- bench -----------------------------------------------------------------------------------------------
def _sizes_arg(text: str) -> tuple[int, ...]:
    from tiercache.adapters.options import parse_size

    try:
        return tuple(parse_size(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_bench(args: argparse.Namespace) -> int:
    import tempfile

    from tiercache.cli.bench import SUITES, run_bench

    suites = args.suites or list(SUITES)
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-") as workdir:
        if args.config:
            from tiercache.config import load_config

            config, label = load_config(args.config), str(args.config)
        else:
            from tiercache.cli.demo import demo_config

            config, label = demo_config(Path(workdir)), "embedded default (L1 + a POSIX tier in a temp dir)"
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
        run_bench(
            config,
            suites,
            Path(args.out),
            quick=args.quick,
            repeat=args.repeat,
            sizes=args.sizes,
            tokens=tokens,
            config_label=label,
        )
    return 0


# ----- main ------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from tiercache import __version__

    parser = argparse.ArgumentParser(prog="tiercache", description="Tiered KV-cache store for LLM inference.")
    parser.add_argument("--version", action="version", version=f"tiercache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo", help="prefill and decode processes share KV through L1/L2; restore and verify it bit-exact"
    )
    p.add_argument("--config", help="config file (default: L1 + a POSIX tier in a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--metrics", action="store_true", help="print the decode process's Prometheus metrics")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "bench", help="benchmark suites against a config: progress bars, a summary, DIR/<suite>.json and .png"
    )
    p.add_argument(
        "suites", nargs="*", metavar="SUITE", help="keys, engine, tiers, codecs, gpu (default: all)"
    )
    p.add_argument("--config", help="config file (default: L1 + a POSIX tier in a temp dir)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (under a minute)")
    p.add_argument(
        "--out", default="bench-results", metavar="DIR", help="output folder (default bench-results)"
    )
    p.add_argument("--repeat", type=int, help="timed repeats per case (default 3 with --quick, else 7)")
    p.add_argument(
        "--sizes", type=_sizes_arg, help="object sizes instead of the suites' own, e.g. 64KiB,4MiB"
    )
    p.add_argument("--tokens", help="request sizes in tokens instead of the suites' own, e.g. 512,4096")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("plugins", help="list the adapters and codecs known, and their distributions")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("check", help="validate a config, open every tier and round-trip a probe object")
    p.add_argument("config", help="config file (TOML or YAML)")
    p.add_argument(
        "--timeout",
        dest="deadline_s",
        type=float,
        default=10.0,
        help="seconds per tier operation (default 10)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "inspect",
        help="decode and verify a frame (header crc, length, payload checksum) from a file, or from a key "
        "in the config's tiers; exit 1 if it is corrupt",
    )
    p.add_argument("target", help="frame file path, or object key (with --config)")
    p.add_argument("--key", help="for a frame file: also check that the frame is bound to this key")
    p.add_argument("--config", help="config whose tiers to search for the key")
    p.add_argument(
        "--timeout", dest="deadline_s", type=float, default=10.0, help="seconds per tier operation"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("conformance", help="run the adapter conformance kit against a live URL")
    p.add_argument("url", help="adapter URL, e.g. file:///tmp/kit or redis://127.0.0.1:6379/0")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments")
    p.set_defaults(func=_cmd_conformance)

    from tiercache.server.cli import add_health_command, add_serve_command

    add_serve_command(sub)
    add_health_command(sub)
    from tiercache.cli.cache import add_cache_command

    add_cache_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (TiercacheError, OSError, ValueError) as exc:
        print(f"tiercache: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
