"""Security campaign: planted secrets (Redis password, a wrong one, AES key, S3 credentials) never show in
``tiercache check`` output, logs, metric labels or exception text, against a real password-protected Redis
and moto S3; ``check`` shows which tiers are encrypted; a frame written under one tenant's salt or one AES
key never decodes under another."""

from __future__ import annotations

import json
import logging
import secrets
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache import cli
from tiercache._open import open_adapter
from tiercache.config import config_from_dict, load_config
from tiercache.errors import AdapterError, FrameError
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import scatter
from tiercache.serde import build_pipeline
from tiercache.serde.aesgcm import AesGcmCodec
from tiercache.store.engine import CacheEngine
from tiercache.testing.harness.s3 import TEST_ENV, MotoServer

PASSWORD = "pw-" + secrets.token_hex(12)
WRONG_PASSWORD = "wrongpw-" + secrets.token_hex(12)
AES_HEX = secrets.token_hex(32)
S3_KEY_ID = "AKIA" + secrets.token_hex(8).upper()
S3_SECRET = "s3secret-" + secrets.token_hex(16)
PLANTED = (PASSWORD, WRONG_PASSWORD, AES_HEX, S3_SECRET, S3_KEY_ID)
"""Never in our output. The S3 access key id (an identifier, not a secret) does show in botocore's own DEBUG
log of the Authorization header, so third-party logs are checked for the secrets alone (``_secret_leaks``)."""
ENV = {"TC_PW": PASSWORD, "TC_BAD_PW": WRONG_PASSWORD, "TC_AES": AES_HEX, "TC_S3_ID": S3_KEY_ID,
       "TC_S3_SECRET": S3_SECRET}  # fmt: skip
LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16"
)


def _leaks(text: str) -> list[str]:
    return [s for s in PLANTED if s in text]


def _secret_leaks(text: str) -> list[str]:
    return [s for s in _leaks(text) if s != S3_KEY_ID]


def _own_logs(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tiercache"))


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**TEST_ENV, **ENV}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def moto_s3(planted: None, tmp_path: Path) -> Iterator[MotoServer]:
    server = MotoServer(log=tmp_path / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()


def _config(tmp_path: Path, redis_port: int, moto: MotoServer) -> Path:
    path = tmp_path / "tiercache.toml"
    path.write_text(f"""
[l1]
capacity = "16MiB"
pinned = false

[manager]
l2_deadline_s = 2.0
circuit_failures = 2

[[tiers]]
name = "redis"
url = "redis://127.0.0.1:{redis_port}/0"
codecs = ["raw", {{id = "aesgcm", key_env = "TC_AES"}}]
options = {{ password_env = "TC_PW" }}

[[tiers]]
name = "badpw"
url = "redis://127.0.0.1:{redis_port}/0"
options = {{ password_env = "TC_BAD_PW" }}

[[tiers]]
name = "s3"
url = "s3://secret-campaign/kv"
codecs = ["raw", "zstd"]
[tiers.options]
endpoint_url = "{moto.endpoint}"
addressing_style = "path"
create_bucket = true
access_key_id_env = "TC_S3_ID"
secret_access_key_env = "TC_S3_SECRET"
""")
    return path


def test_check_output_and_logs_hold_no_secret_and_show_encryption(
    redis_factory: Callable[..., Any],
    moto_s3: MotoServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory("--requirepass", PASSWORD)
    config = _config(tmp_path, server.port, moto_s3)
    caplog.set_level(logging.DEBUG)
    code = cli.main(["check", str(config)])
    text = capsys.readouterr()
    assert code != 0, text  # the wrong-password tier fails
    lines = {line.split()[0]: line for line in text.out.splitlines() if line.startswith("  ")}
    assert "encrypted (aesgcm)" in lines["redis"]
    assert lines["redis"].rstrip().endswith("OK")
    assert "not encrypted" in lines["s3"]
    assert lines["s3"].rstrip().endswith("OK")
    assert "FAIL" in lines["badpw"]
    assert cli.main(["check", str(config), "--json"]) != 0
    as_json = capsys.readouterr().out
    rows = {r["tier"]: r for r in json.loads(as_json)["tiers"]}
    assert rows["redis"]["encrypted"] == "aesgcm"
    assert rows["s3"]["encrypted"] is None
    for where, captured in (("stdout", text.out), ("json", as_json), ("logs", _own_logs(caplog))):
        assert _leaks(captured) == [], f"secret in {where}"
    # stderr and the captured logs hold every logger's records, botocore's DEBUG included
    assert _secret_leaks(text.err) == []
    assert _secret_leaks(caplog.text) == []


@pytest.mark.asyncio
async def test_metrics_logs_and_errors_hold_no_secret(
    redis_factory: Callable[..., Any], moto_s3: MotoServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_factory("--requirepass", PASSWORD)
    config = load_config(_config(tmp_path, server.port, moto_s3))
    caplog.set_level(logging.DEBUG)
    # an exception from the wrong password: neither its text nor its traceback holds a secret
    bad = config.tier("badpw")
    with pytest.raises(AdapterError) as info:
        await open_adapter(bad.url, **bad.adapter_options())
    assert _leaks("".join(traceback.format_exception(info.value))) == []
    engine = await CacheEngine.open(config, LAYOUT, model="t/secrets")
    try:
        gen = torch.Generator().manual_seed(0)
        kv = torch.randn(object_spec(LAYOUT, 512).shape, generator=gen).to(torch.bfloat16)
        cache = [torch.zeros(LAYOUT.layer_shape(32), dtype=torch.bfloat16) for _ in range(2)]
        slots = torch.arange(512)
        scatter(cache, Move.scatter(LAYOUT, slots, [(0, 512)], [kv]))
        assert await engine.store(list(range(512)), cache, slots) == 512
        await engine.drain()
        metrics = engine.manager.metrics
        assert metrics.value("tiercache_stores_total", tier="redis") == 2
        assert metrics.value("tiercache_stores_total", tier="s3") == 2
        assert metrics.value("tiercache_tier_down", tier="badpw") == 1.0  # kept as a down tier
        rendered = metrics.render()
        assert _leaks(rendered) == []
        with pytest.raises(AdapterError) as down:
            await engine.manager.tiers[1].adapter.batched_get(["k"])
        assert _leaks(str(down.value) + repr(down.value)) == []
    finally:
        await engine.aclose()
    assert _leaks(_own_logs(caplog)) == []
    assert _secret_leaks(caplog.text) == []


@pytest.mark.asyncio
async def test_a_frame_of_one_tenant_or_aes_key_never_decodes_under_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANT_SALT", "tenant-a")
    config = config_from_dict(
        {
            "cache_salt_env": "TENANT_SALT",
            "l1": {"capacity": "8MiB", "pinned": False},
            "tiers": [{"name": "disk", "url": f"file://{tmp_path}/l2"}],
        }
    )
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(object_spec(LAYOUT, 256).shape, generator=gen).to(torch.bfloat16)
    cache = [torch.zeros(LAYOUT.layer_shape(16), dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.arange(256)
    scatter(cache, Move.scatter(LAYOUT, slots, [(0, 256)], [kv]))
    tokens = list(range(256))
    a = await CacheEngine.open(config, LAYOUT, model="t/tenants")
    try:
        key_a = str(a.token_db.keys(tokens)[0])
        assert await a.store(tokens, cache, slots) == 256
        await a.drain()
    finally:
        await a.aclose()
    monkeypatch.setenv("TENANT_SALT", "tenant-b")
    b = await CacheEngine.open(config, LAYOUT, model="t/tenants")
    try:
        key_b = str(b.token_db.keys(tokens)[0])
        assert await b.lookup(tokens) == 0  # tenant b's keys differ: nothing of tenant a is found
    finally:
        await b.aclose()
    assert key_b != key_a
    # The stored frame itself, presented under tenant b's key for the same tokens, is rejected.
    files = [p for p in (tmp_path / "l2").rglob("*") if p.is_file()]
    assert [f.name for f in files] == [key_a]
    frame = files[0].read_bytes()
    pipe = build_pipeline(["raw"])
    out = bytearray(object_spec(LAYOUT, 256).nbytes)
    pipe.decode_into(frame, key_a, out)  # the right tenant decodes it
    with pytest.raises(FrameError):
        pipe.decode_into(frame, key_b, bytearray(len(out)))
    # One AES key's frame never decodes under another key (nor in the clear).
    sealed = build_pipeline(["raw", AesGcmCodec(bytes.fromhex(AES_HEX))])
    other = build_pipeline(["raw", AesGcmCodec(secrets.token_bytes(32))])
    enc = sealed.encode(bytearray(out), object_spec(LAYOUT, 256), key_a)
    with pytest.raises(FrameError):
        other.decode_into(enc, key_a, bytearray(len(out)))
    with pytest.raises(FrameError):
        pipe.decode_into(enc, key_a, bytearray(len(out)))
    got = bytearray(len(out))
    sealed.decode_into(enc, key_a, got)
    assert got == out
