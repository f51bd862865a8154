"""The tiercache command: plugins, check (per-tier OK, typo'd key), inspect, clear one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m tiercache *args`` (``env`` added to this environment), its output captured as text."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "tiercache", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def test_plugins_lists_builtins_with_their_distribution() -> None:
    proc = run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(proc.stdout)}
    assert rows[("adapter", "file")]["distribution"] == "tiercache"
    assert rows[("adapter", "memory")]["target"].endswith(":MemoryAdapter")
    assert ("codec", "raw") in rows
    text = run("plugins").stdout
    assert "adapters:" in text
    assert "codecs:" in text


def test_check_embedded_default_reports_every_tier_ok(tmp_path: Path) -> None:
    proc = run("check", str(EXAMPLES / "embedded.toml"), env={"TIERCACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "disk" in proc.stdout
    assert proc.stdout.count("OK") == 2  # L1 and the POSIX tier
    as_json = json.loads(
        run("check", str(EXAMPLES / "embedded.toml"), "--json", env={"TIERCACHE_DIR": str(tmp_path)}).stdout
    )
    assert as_json["ok"] is True
    assert as_json["tiers"][0]["frame_bytes"] > as_json["tiers"][0]["raw_bytes"]
    assert not list((tmp_path / "l2").rglob("tiercache-check*"))  # the probe was deleted


def test_check_with_a_typo_exits_non_zero_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "typo.toml"
    config.write_text('chunk_size = 256\n[[tiers]]\nname = "d"\nurl = "file:///tmp/x"\ncapacty = "1GiB"\n')
    proc = run("check", str(config))
    assert proc.returncode == 2
    assert "'tiers[0].capacty'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_check_reports_an_unreachable_tier_as_fail(tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[[tiers]]\nname = "ok"\nurl = "memory://m"\n[[tiers]]\nname = "broken"\nurl = "file://{blocker}/sub"\n'
    )
    proc = run("check", str(config))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert any("ok" in line and line.rstrip().endswith("OK") for line in lines)
    assert any("broken" in line and "FAIL" in line for line in lines)


def test_inspect_decodes_a_frame_file(tmp_path: Path) -> None:
    from tiercache.serde import build_pipeline
    from tiercache.spec import KVSpec

    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", tokens=5)
    frame = build_pipeline(["raw"]).encode(
        bytes(range(256)) * (spec.nbytes // 256) + bytes(spec.nbytes % 256), spec, "some.key"
    )
    path = tmp_path / "frame.bin"
    path.write_bytes(frame)
    proc = run("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["chain"] == ["raw"]
    assert info["tokens"] == 5
    assert info["dtype"] == "float16"
    assert info["raw_bytes"] == spec.nbytes
    assert info["verified"] is True
    assert info["problems"] == []
    assert run("inspect", str(path), "--key", "some.key").returncode == 0
    path.write_bytes(b"NOPE" + frame[4:])
    bad = run("inspect", str(path))
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr


def test_inspect_verifies_the_payload_and_exits_non_zero_on_a_corrupt_frame(tmp_path: Path) -> None:
    """A header that reads fine over a damaged, short or long payload, or a frame of another key, is
    reported as corrupt with exit status 1 (the header fields are still shown)."""
    from tiercache.serde import build_pipeline
    from tiercache.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=4)
    frame = bytes(build_pipeline(["raw"]).encode(bytes(i % 251 for i in range(spec.nbytes)), spec, "k.1"))
    path = tmp_path / "frame.bin"
    flipped = bytearray(frame)
    flipped[-1] ^= 0x01
    cases: dict[str, tuple[bytes, list[str], str]] = {
        "flipped": (bytes(flipped), [], "payload checksum mismatch"),
        "short": (frame[:-1], [], "header says"),
        "long": (frame + b"x", [], "header says"),
        "other key": (frame, ["--key", "k.2"], "not bound to key 'k.2'"),
    }
    for name, (data, extra, message) in cases.items():
        path.write_bytes(data)
        proc = run("inspect", str(path), *extra, "--json")
        assert proc.returncode == 1, name
        info = json.loads(proc.stdout)
        assert info["verified"] is False, name
        assert any(message in p for p in info["problems"]), (name, info["problems"])
        assert info["tokens"] == 4, name
        assert "corrupt frame" in proc.stderr, name
        text = run("inspect", str(path), *extra)
        assert text.returncode == 1, name
        assert "CORRUPT" in text.stdout, name


def test_version_prints_the_package_version() -> None:
    from tiercache import __version__

    proc = run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tiercache {__version__}"


@pytest.mark.parametrize("args", [["inspect", "not-a-file-or-key"], ["check", "/no/such/config.toml"]])
def test_errors_are_one_line(args: list[str]) -> None:
    proc = run(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("tiercache: error:")
    assert "Traceback" not in proc.stderr


def test_conformance_runs_the_kit_against_a_url(tmp_path: Path) -> None:
    proc = run("conformance", f"file://{tmp_path}/kit", "-x", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
    assert "failed" not in proc.stdout
    bad = run("conformance", "gopher://nowhere", cwd=tmp_path, timeout=300)
    assert bad.returncode != 0


def test_conformance_never_reformats_a_live_slab(tmp_path: Path) -> None:
    """``conformance`` refuses a URL asking for a reformat; the slab's objects stay."""
    import asyncio

    from tiercache.adapters.nvme_slab import SlabAdapter

    url = f"nvme+slab://{tmp_path}/live.slab?capacity=64MiB&max_object=1MiB&extent_size=8MiB"

    async def put_then_read(put: bool) -> list[bool]:
        slab = await SlabAdapter.open(url, preallocate=False)
        try:
            if put:
                await slab.batched_put(["live"], [b"precious"])
            return await slab.batched_contains(["live"])
        finally:
            await slab.aclose()

    assert asyncio.run(put_then_read(True)) == [True]
    for value in ("true", "1", "yes"):
        proc = run("conformance", f"{url}&format={value}", "-x", cwd=tmp_path, timeout=300)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "never reformats" in proc.stderr
    assert asyncio.run(put_then_read(False)) == [True]


def test_a_planted_password_is_never_printed_or_logged(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A password planted in every place a config or URL can hold one never reaches stdout,
    stderr or the logs of ``check`` (text and JSON) and ``conformance``; the refusals name ``*_env``."""
    import logging

    from tiercache.cli import main

    planted = "Pw7Secret/xyz"
    monkeypatch.setenv("TC_PLANTED_SECRET", planted)
    urls = [
        f"redis://default:{planted}@127.0.0.1:1/0",
        f"rediss://user:{planted}?x#y@127.0.0.1:1/0",
        f"redis+cluster://u:{planted}@127.0.0.1:1,127.0.0.1:2",
        "redis://127.0.0.1:1/0?password=${TC_PLANTED_SECRET}",
        "redis://default:${TC_PLANTED_SECRET}@127.0.0.1:1/0",
        f"redis://127.0.0.1:1/0?pass={planted}",
        f"s3://bucket/prefix?aws_secret_access_key={planted}",
        f"s3://bucket/prefix?endpoint_url=http://ak:{planted}@127.0.0.1:1",
        f"mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata&token={planted}",
    ]
    tiers = [f'[[tiers]]\nname = "t"\nurl = "{url}"\n' for url in urls]
    tiers += [
        f'[[tiers]]\nname = "t"\nurl = "redis://127.0.0.1:1/0"\noptions = {{ password = "{planted}" }}\n',
        f'[[tiers]]\nname = "t"\nurl = "file:///tmp/x"\ncodecs = [{{ id = "aesgcm", key = "{planted}" }}]\n',
        # accepted (the secret comes from the environment); the tier is unreachable: the error is printed
        '[[tiers]]\nname = "t"\nurl = "redis://127.0.0.1:1/0"\n'
        'options = { password_env = "TC_PLANTED_SECRET", socket_timeout = 0.5 }\n',
    ]
    caplog.set_level(logging.DEBUG)
    outputs = []
    for i, tier in enumerate(tiers):
        path = tmp_path / f"c{i}.toml"
        path.write_text(tier)
        for args in (["check", str(path)], ["check", str(path), "--json"]):
            code = main(args)
            out, err = capsys.readouterr()
            outputs.append(out + err)
            if i < len(tiers) - 1:
                assert code == 2, out + err
                assert "_env" in err, err
            else:
                assert code == 1, out + err
    for url in urls[:3]:
        assert main(["conformance", url]) == 2
        out, err = capsys.readouterr()
        assert "password_env" in err
        outputs.append(out + err)
    everything = "\n".join(outputs) + "\n".join(r.getMessage() for r in caplog.records)
    for piece in (planted, *planted.split("/")):
        assert piece not in everything
