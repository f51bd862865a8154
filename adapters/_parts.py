"""The manifest of a Redis value stored as several part keys (see ``adapters/redis.py``, "Large values").

A parted object is ``count`` part keys ``<head>#<i>`` (``part_size`` bytes of the value each, the last one
shorter, each followed by the write's nonce) and, written last, the head key ``<head>`` holding this
manifest: a magic, the total size, the part size, the count and the random nonce of this write. A rewrite
overwrites the parts in place (the server reuses their memory), so a reader checks every part's length and
nonce against the manifest it read: a part that is missing, short or of another write is a miss, never a
mix. Object keys are ``[A-Za-z0-9._-]`` only, so a part key (with ``#``) never names an object.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = ["MAGIC", "MANIFEST_BYTES", "NONCE_BYTES", "Manifest", "part_key"]

MAGIC = b"\x00\xfftiercache:pt1\x00"
"""First bytes of every manifest; a value that starts with them is always stored parted (never mistaken)."""
NONCE_BYTES = 16
"""Length of a write's nonce, the tail of each of its parts."""
_LAYOUT = struct.Struct(f"<{len(MAGIC)}sQQI{NONCE_BYTES}s")
MANIFEST_BYTES = _LAYOUT.size
"""Length of an encoded manifest (a head of any other length is a plain value)."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """Which part keys hold an object: ``count`` parts of ``part_size`` bytes (the last one shorter)."""

    total: int
    part_size: int
    nonce: bytes

    @classmethod
    def new(cls, total: int, part_size: int) -> Manifest:
        """A manifest for a fresh write of ``total`` bytes (a new random nonce)."""
        return cls(total, part_size, os.urandom(NONCE_BYTES))

    @property
    def count(self) -> int:
        """Number of parts (at least one, even for an empty value)."""
        return max(1, -(-self.total // self.part_size))

    def bounds(self) -> list[tuple[int, int]]:
        """(start, end) byte offsets of each part in the whole value."""
        return [(i * self.part_size, min((i + 1) * self.part_size, self.total)) for i in range(self.count)]

    def part_keys(self, head: str, start: int = 0) -> list[str]:
        """The full keys of parts ``start``.. of the object whose full key is ``head``."""
        return [part_key(head, i) for i in range(start, self.count)]

    def encode(self) -> bytes:
        return _LAYOUT.pack(MAGIC, self.total, self.part_size, self.count, self.nonce)

    @classmethod
    def decode(cls, head: bytes | memoryview, max_total: int) -> Manifest | None:
        """The manifest in ``head``; None if it is none or does not add up (wrong length or count, a size
        over ``max_total``, a part size of 0). A head that ``looks_like`` one and decodes to None is corrupt.
        """
        view = memoryview(head)
        if view.nbytes != MANIFEST_BYTES or view[: len(MAGIC)] != MAGIC:
            return None
        _, total, part_size, count, nonce = _LAYOUT.unpack(view)
        if part_size < 1 or total > max_total:
            return None
        found = cls(total, part_size, nonce)
        return found if found.count == count else None

    @staticmethod
    def looks_like(head: bytes | memoryview) -> bool:
        """Whether ``head`` starts with the manifest magic (such a value must be stored parted)."""
        return memoryview(head)[: len(MAGIC)] == MAGIC


def part_key(head: str, index: int) -> str:
    """The full key of part ``index`` of the object whose full key is ``head``."""
    return f"{head}#{index}"
