"""tiercache demo: the toy model's KV is the same bytes in every process, whatever math kernels it runs on;
the demo says when the prefill's stores did not reach a tier.

The decode verifies what it restores against the KV it computes itself, so a frame stored by a process that
computed other bytes for the same tokens (another CPU, another torch build, ``ATEN_CPU_CAPABILITY``) would
restore as wrong KV with the hit, read and written counts of a passing run. Here the prefill runs on torch's
scalar kernels (``ATEN_CPU_CAPABILITY=default``) and the decode on the machine's own (vectorized ones on any
x86 CPU with AVX2), as two real processes sharing one ``file://`` directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache.gpu import Move, reference
from tiercache.gpu.layouts import object_spec

SCALAR = {"ATEN_CPU_CAPABILITY": "default"}

_DIGESTS = """
import hashlib, torch
from tiercache.cli.demo import demo_layout, demo_requests, expected_kv
layout = demo_layout()
for r in demo_requests():
    kv = expected_kv(r.tokens, layout)
    print(r.name, hashlib.sha256(kv.view(torch.int16).numpy().tobytes()).hexdigest())
print("capability", torch.backends.cpu.get_cpu_capability())
"""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    return {**env, **(extra or {})}


def _python(args: list[str], extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", *args],
        capture_output=True,
        text=True,
        env=_env(extra),
        timeout=180,
        check=False,
    )


def _digests(extra: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    proc = _python(["-c", _DIGESTS], extra)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    capability = lines.pop("capability")
    return lines, capability


def test_toy_kv_is_the_same_bytes_on_scalar_and_vectorized_kernels() -> None:
    native, native_capability = _digests()
    scalar, scalar_capability = _digests(SCALAR)
    assert scalar_capability == "DEFAULT"
    assert len(native) == 6
    assert scalar == native, f"the toy KV differs between {scalar_capability} and {native_capability} kernels"


def test_prefill_and_decode_on_different_math_kernels_restore_bit_exact(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    pre = _python(
        ["-m", "tiercache.cli.demo", "prefill", "--workdir", str(workdir), "--out", str(workdir / "p.json")],
        SCALAR,
    )
    assert pre.returncode == 0, pre.stderr
    dec = _python(
        ["-m", "tiercache.cli.demo", "decode", "--workdir", str(workdir), "--out", str(workdir / "d.json")]
    )
    assert dec.returncode == 0, dec.stderr
    rows = json.loads((workdir / "d.json").read_text())["requests"]
    assert [r["name"] for r in rows if not r["verified"]] == [], dec.stderr
    assert sum(r["l2_hit"] for r in rows) > 0  # restored from the frames the scalar prefill stored
    assert json.loads((workdir / "p.json").read_text())["stores_dropped"] == {"disk": 0}


def test_the_demo_names_the_stores_its_prefill_dropped(tmp_path: Path) -> None:
    config = tmp_path / "demo.toml"
    config.write_text(
        'chunk_size = 256\n\n[l1]\ncapacity = "256MiB"\n\n[manager]\nstore_queue_size = 1\n\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}/l2"\ncapacity = "1GiB"\ncodecs = ["raw"]\n'
    )
    out = tmp_path / "out.json"
    proc = _python(["-m", "tiercache", "demo", "--config", str(config), "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    dropped = result["prefill"]["stores_dropped"]["disk"]
    assert dropped >= 5  # a queue of one: chat-a's other five chunks at least
    assert f"prefill stores dropped: disk {dropped} (" in proc.stdout
    assert all(r["verified"] for r in result["requests"])  # what was dropped is a miss, recomputed


def _frame_of_other_kv(config: Any, tokens: tuple[int, ...], chunk: int) -> None:
    """Store, under chat-a's key of ``chunk`` in the file tier, a valid frame of another prompt's KV (what a
    process that computed other bytes for these tokens would store)."""
    from tiercache.cli import demo
    from tiercache.metrics import Metrics

    async def go() -> None:
        layout = demo.demo_layout()
        engine = await demo._open_engine(config, layout, Metrics())
        try:
            hit = await engine.lookup_hit(list(tokens), prefetch=False)
            key, spec = hit.keys[chunk], hit.specs[chunk]
            cs = config.chunk_size
            other = demo.expected_kv([t + 1 for t in tokens], layout)[:, :, chunk * cs : (chunk + 1) * cs]
            (tier,) = engine.manager.tiers
            assert await tier.adapter.batched_put(
                [key], [tier.pipeline.encode(other.contiguous(), spec, key)]
            )
        finally:
            await engine.aclose()

    asyncio.run(go())


def test_a_wrong_restore_says_what_the_object_that_served_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache.cli import demo
    from tiercache.store.engine import PreparedRetrieve

    config = demo.demo_config(tmp_path)
    asyncio.run(demo.prefill(config))
    chat_a = demo.demo_requests()[0]
    _frame_of_other_kv(config, chat_a.tokens, 2)  # tokens 512..767, shared by the five chat requests
    rows = {r["name"]: r for r in asyncio.run(demo.decode(config))["requests"]}
    assert [name for name, r in rows.items() if r["verified"]] == ["solo"]
    assert rows["chat-a"]["hit"] == rows["chat-a"]["written"] == 1400  # the counts of a passing run
    why = rows["chat-a"]["failed_checks"][demo.CHECK_BYTES]
    assert why.startswith("bytes: token 512 differs")
    assert "chunk 2 served by disk" in why
    assert "; its object in disk holds other KV (" in why
    assert "; its L1 object holds other KV (" in rows["chat-b"]["failed_checks"][demo.CHECK_BYTES]

    # the frame is right but the copy into the paged KV is not
    asyncio.run(demo.prefill(config))  # the prefill's frame again
    scatter = PreparedRetrieve.scatter

    def damaged(self: PreparedRetrieve, kv_caches: Any, slot_mapping: torch.Tensor) -> None:
        scatter(self, kv_caches, slot_mapping)
        if self.num_tokens == 700:  # solo, from disk
            ones = torch.ones(object_spec(self.engine.layout, 1).shape, dtype=torch.bfloat16)
            move = Move.scatter(self.engine.layout, slot_mapping[600:601], [(0, 1)], [ones])
            reference.scatter(kv_caches, move)

    monkeypatch.setattr(PreparedRetrieve, "scatter", damaged)
    rows = {r["name"]: r for r in asyncio.run(demo.decode(config))["requests"]}
    assert [name for name, r in rows.items() if not r["verified"]] == ["solo"]
    why = rows["solo"]["failed_checks"][demo.CHECK_BYTES]
    assert why.startswith("bytes: token 600 differs")
    assert "chunk 2 served by disk" in why
    assert why.endswith("; its object in disk holds the prefill's KV (the copy out of it went wrong)")
