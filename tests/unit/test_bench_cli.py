"""``tiercache bench --quick --out DIR`` at a tiny size: JSON schema, real PNGs, consistent numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiercache.cli.bench import SCHEMA_VERSION, SUITES
from tiercache.cli.bench.measure import NOISE_LIMIT, percentiles, ratio, spread

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOC_KEYS = {
    "suite",
    "description",
    "schema_version",
    "config",
    "quick",
    "repeat",
    "host",
    "seconds",
    "skipped",
    "notes",
    "rows",
    "noisy",
    "load_avg_at_end",
}
ROW_KEYS = {
    "case",
    "size",
    "value",
    "unit",
    "size_unit",
    "raw",
    "baseline",
    "ratio",
    "latency_s",
    "extra",
    "spread",
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One tiny run of every suite (the embedded default config: L1 + a POSIX tier in a temp dir)."""
    out = tmp_path_factory.mktemp("bench") / "out"
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("tiercache")),
            "bench",
            "--quick",
            "--out",
            str(out),
            "--sizes",
            "4KiB,64KiB",
            "--tokens",
            "256,512",
            "--repeat",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=out.parent,
    )
    return out, done


def _doc(out: Path, suite: str) -> dict[str, Any]:
    return json.loads((out / f"{suite}.json").read_text())  # type: ignore[no-any-return]


def test_run_succeeds_and_shows_progress_and_summary(
    bench_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """Exit 0; progress lines per suite and the summary table go to stderr."""
    out, done = bench_run
    assert done.returncode == 0, done.stderr[-3000:]
    for suite in SUITES:
        assert suite in done.stderr
    assert "tiercache bench summary" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{s}.{ext}" for s in SUITES for ext in ("json", "png")
    )


@pytest.mark.parametrize("suite", list(SUITES))
def test_json_schema_and_consistent_numbers(bench_run: tuple[Path, Any], suite: str) -> None:
    """Every document has the schema's keys; ratio == value / raw; percentiles ordered; sizes as asked."""
    out, _ = bench_run
    doc = _doc(out, suite)
    assert set(doc) == DOC_KEYS
    assert doc["suite"] == suite
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["quick"] is True
    assert doc["repeat"] == 2
    assert doc["config"].startswith("embedded default")
    if doc["skipped"]:
        assert doc["rows"] == []
        return
    assert doc["rows"]
    for row in doc["rows"]:
        assert set(row) == ROW_KEYS
        assert row["value"] > 0
        assert math.isfinite(row["value"])
        if row["raw"] is None:
            assert row["ratio"] is None
        else:
            assert row["ratio"] == pytest.approx(row["value"] / row["raw"], rel=1e-12)
        lat = row["latency_s"]
        if lat and len(lat) == 3:
            assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
        sp = row["spread"]
        if sp:
            assert sp["repeats"] >= 2
            assert isinstance(sp["noisy"], bool)
            if f"{row['case']} @ {row['size']} {row['size_unit']}" in doc["noisy"]:
                assert sp["noisy"]
            if "ratio_p10" in sp:
                assert sp["ratio_p10"] <= sp["ratio_p50"] <= sp["ratio_p90"]


def test_requested_sizes_are_the_ones_measured(bench_run: tuple[Path, Any]) -> None:
    """--sizes drives the tier suite's object sizes and --tokens the keys suite's request sizes."""
    out, _ = bench_run
    tiers = _doc(out, "tiers")
    assert {r["size"] for r in tiers["rows"]} == {4096, 65536}
    assert {r["case"] for r in tiers["rows"]} == {"disk put", "disk get"}
    assert all(r["baseline"].startswith("raw file I/O") for r in tiers["rows"])
    keys = _doc(out, "keys")
    assert {r["size"] for r in keys["rows"] if r["case"] == "process_tokens"} == {256, 512}
    engine = _doc(out, "engine")
    store = [r for r in engine["rows"] if r["case"] == "store"]
    assert [r["extra"]["tokens"] for r in store] == [256, 512]
    assert all(r["extra"]["verified"] for r in store)


def test_codec_rows_verify_lossless_chains(bench_run: tuple[Path, Any]) -> None:
    """Lossless chains round-trip bit-exact; lossy ones report a bounded relative error."""
    out, _ = bench_run
    for row in _doc(out, "codecs")["rows"]:
        extra = row["extra"]
        if extra["lossless"]:
            assert extra["verified"] is True, row["case"]
        else:
            assert 0 <= extra["relative_error"] < 0.1, row["case"]
        assert extra["size_ratio"] == pytest.approx(row["size"] / extra["frame_bytes"])


@pytest.mark.parametrize("suite", list(SUITES))
def test_pngs_are_real_images(bench_run: tuple[Path, Any], suite: str) -> None:
    """Each PNG starts with the PNG signature, has an IHDR of the figure's size and real content."""
    out, _ = bench_run
    data = (out / f"{suite}.png").read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    doc = _doc(out, suite)
    groups = max(1, len({(r["unit"], r["size_unit"]) for r in doc["rows"]}))  # one line of panels per unit
    assert (width, height) == (18 * 80, int(5.5 * groups * 80))
    assert len(data) > 10_000  # axes, lines and labels, not a blank canvas


def test_unknown_suite_is_a_clear_error(tmp_path: Path) -> None:
    """A misspelt suite fails fast with the list of suites, before running anything."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("tiercache")), "bench", "--out", str(tmp_path), "kyes"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "unknown bench suite(s) kyes; suites: keys, engine, tiers, codecs, gpu" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_measure_helpers() -> None:
    """Nearest-rank percentiles and the ratio's edge cases."""
    assert percentiles([3.0, 1.0, 2.0, 4.0]) == {"p50": 2.0, "p90": 4.0, "p99": 4.0}
    assert percentiles([5.0]) == {"p50": 5.0, "p90": 5.0, "p99": 5.0}
    samples = [float(i) for i in range(1, 101)]
    assert percentiles(samples) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(2.0, None) is None
    assert ratio(2.0, 0.0) is None


def test_an_unreachable_tier_is_a_note_not_a_crash(tmp_path: Path) -> None:
    """A tier that cannot be opened is reported in the suite's notes; the other tiers are still measured."""
    config = tmp_path / "tiers.toml"
    config.write_text(
        '[[tiers]]\nname = "down"\nurl = "redis://127.0.0.1:1/0"\noptions = { socket_timeout = 0.5 }\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}/l2"\n'
    )
    out = tmp_path / "out"
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("tiercache")),
            "bench",
            "--config",
            str(config),
            "--out",
            str(out),
            "--sizes",
            "4KiB",
            "--repeat",
            "2",
            "tiers",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = _doc(out, "tiers")
    assert doc["config"] == str(config)
    assert {r["case"] for r in doc["rows"]} == {"disk put", "disk get"}
    assert len(doc["notes"]) == 1
    assert doc["notes"][0].startswith("tier 'down' not measured: AdapterUnavailable")


def test_spread_pairs_interleaved_repeats_and_marks_noise() -> None:
    """The ratio's range comes from the interleaved pairs; a baseline that moved past NOISE_LIMIT over its
    repeats marks the row noisy, a steady one does not."""
    steady = spread([2.0, 2.0, 2.1, 2.0], [1.0, 1.0, 1.05, 1.0])
    assert steady["noisy"] is False
    assert steady["repeats"] == 4
    assert steady["ratio_p50"] == pytest.approx(0.5)
    assert steady["ratio_p10"] <= 0.5 <= steady["ratio_p90"]
    # load hit pairs 3 and 4 alike: per-pair ratios stay 0.5 although both sides slowed 4x
    loaded = spread([2.0, 2.0, 8.0, 8.0, 2.0], [1.0, 1.0, 4.0, 4.0, 1.0])
    assert loaded["noisy"] is True
    assert loaded["raw_p90_over_p10"] == pytest.approx(4.0)
    assert loaded["ratio_p10"] == loaded["ratio_p90"] == pytest.approx(0.5)
    alone = spread([1.0, 1.0 * NOISE_LIMIT * 1.1])
    assert alone["noisy"] is True
    assert "ratio_p10" not in alone
    unequal = spread([2.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert unequal["ratio_p10"] == pytest.approx(0.25)
    assert unequal["ratio_p90"] == pytest.approx(0.5)
    assert spread([]) == {}


def test_summary_marks_noisy_rows_and_shows_the_ratio_band() -> None:
    from rich.console import Console

    from tiercache.cli.bench.report import summary_table

    row = {
        "case": "disk get",
        "size": 4096,
        "size_unit": "bytes",
        "value": 1.0,
        "unit": "GB/s",
        "raw": 2.0,
        "ratio": 0.5,
        "latency_s": {},
        "spread": {"noisy": True, "ratio_p10": 0.25, "ratio_p90": 0.75},
    }
    console = Console(width=200, record=True)
    console.print(summary_table([{"suite": "tiers", "skipped": None, "rows": [row]}]))
    text = console.export_text()
    assert "0.50 !" in text
    assert "0.25-0.75" in text
