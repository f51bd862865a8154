"""A Mooncake store with no segment memory fails ``open`` with a message that names both fixes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.adapters.mooncake import MooncakeAdapter
from tiercache.errors import AdapterUnavailable


def _url(rpc: int, http: int, query: str = "") -> str:
    return f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata&protocol=tcp{query}"


@pytest.mark.asyncio
async def test_no_segment_memory_names_the_fix(mooncake_master_alone: tuple[int, int]) -> None:
    """Master alone + segment_size=0: open says there is no segment memory and names both fixes."""
    rpc, http = mooncake_master_alone
    with pytest.raises(AdapterUnavailable) as caught:
        await MooncakeAdapter.open(_url(rpc, http))
    message = str(caught.value)
    assert "no segment memory" in message
    assert "--global_segment_size" in message
    assert "segment_size" in message.split("--global_segment_size", 1)[1]  # the adapter option, too


@pytest.mark.asyncio
async def test_own_segment_makes_the_same_master_usable(mooncake_master_alone: tuple[int, int]) -> None:
    """The second fix works: with segment_size the adapter lends its own memory and objects round-trip."""
    rpc, http = mooncake_master_alone
    adapter = await MooncakeAdapter.open(_url(rpc, http, "&segment_size=64MiB&buffer_size=16MiB"))
    try:
        assert await adapter.batched_put(["placed"], [b"value"]) == [True]
        assert await adapter.batched_get(["placed"]) == [b"value"]
    finally:
        await adapter.aclose()


def test_check_command_reports_it(mooncake_master_alone: tuple[int, int], tmp_path: Path) -> None:
    """``tiercache check`` shows the same message for the tier instead of 'probe put was refused'."""
    rpc, http = mooncake_master_alone
    config = tmp_path / "mc.toml"
    config.write_text(f'[[tiers]]\nname = "mc"\nurl = "{_url(rpc, http)}"\n')
    done = subprocess.run(
        [str(Path(sys.executable).with_name("tiercache")), "check", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    (tier,) = json.loads(done.stdout)["tiers"]
    assert "no segment memory" in tier["error"]
    assert "--global_segment_size" in tier["error"]
