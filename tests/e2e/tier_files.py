"""A file tier's objects as the e2e tests handle them: its frames (the ``tc*`` files), a fresh copy of a
tier, and a frame damaged so that it fails its checksum (a lookup still finds it). Tests import
``tests.e2e.tier_files``."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["damage", "frames", "tier_copy"]


def frames(tier: Path) -> list[Path]:
    """The frames under the file tier's directory ``tier``, sorted by path."""
    return sorted(p for p in tier.rglob("tc*") if p.is_file())


def tier_copy(tier: Path, to: Path) -> Path:
    """``to``, made a fresh copy of the file tier in ``tier`` (whatever was there before is removed)."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(tier, to)
    return to


def damage(frame: Path) -> None:
    """Flip one payload byte of ``frame``: it fails its checksum."""
    data = bytearray(frame.read_bytes())
    data[-100] ^= 0xFF
    frame.write_bytes(bytes(data))
