"""A delete by prefix on a restarted ``tiercache serve`` reaches what the earlier server stored in its file
tier (the tier lists its keys), and leaves another keyspace's objects there."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.unit.test_cache_control import Node, prompt, run_cli, serve
from tiercache.adapters.posix import PosixAdapter

FOREIGN = "tc1.0123456789abcdef.other"


async def _foreign(root: Path, put: bool) -> bool:
    """Put (or look up) one object of another keyspace directly in the file tier; whether it is there."""
    adapter = await PosixAdapter.open(f"file://{root}")
    try:
        if put:
            assert await adapter.batched_put([FOREIGN], [b"another model"]) == [True]
        return (await adapter.batched_contains([FOREIGN]))[0]
    finally:
        await adapter.aclose()


def test_delete_by_prefix_after_a_restart_reaches_the_earlier_servers_objects(
    tmp_path: Path, sock_dir: Path
) -> None:
    sock = sock_dir / "l1.sock"
    ours = prompt(1)
    server = serve(tmp_path, sock)
    try:
        node = Node(server.path)
        assert node.store(ours) == len(ours)
        node.drain(server.path)
        asyncio.run(node.engine.aclose())
    finally:
        server.stop()
    assert asyncio.run(_foreign(tmp_path / "l2", put=True))
    server = serve(tmp_path, sock)  # a fresh server: its event sink never saw the objects stored
    try:
        node = Node(server.path)
        assert node.tiers(ours) == ("disk", "disk")
        answer = run_cli("delete", "--socket", server.path, "--prefix", node.engine.token_db.key_prefix)
        assert answer["deleted"] == 2  # both chunks, from the disk tier
        assert node.tiers(ours) == ()
        asyncio.run(node.engine.aclose())
    finally:
        server.stop()
    assert asyncio.run(_foreign(tmp_path / "l2", put=False))  # another keyspace's object stays
