"""On-disk layout of the ``nvme+slab`` store: geometry, slot classes and the checksummed metadata records.

File (or block device) layout, all integers little-endian::

    [0, 4096)                     superblock
    then n_extents times:
      [table, table + T)          extent table: a 4 KiB extent header, then one 512-byte record per slot
      [data, data + D)            extent data: slots of the extent's class, back to back

An extent is assigned to one slot class when it is first needed (its header names the class and a
*generation*); records carry the generation, so reassigning an extent invalidates all its old records at once.
Every structure ends with an xxh3_64 of the bytes before it and carries the slab's random ``format_id``:
a torn, stale or foreign structure is simply ignored on replay.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

import xxhash

__all__ = [
    "HEADER_BYTES",
    "MIN_CLASS",
    "RECORD_BYTES",
    "Geometry",
    "Record",
    "align_up",
    "bytes_text",
    "class_index",
    "class_sizes",
    "pack_extent_header",
    "pack_record",
    "pack_superblock",
    "tombstone",
    "unpack_extent_header",
    "unpack_record",
    "unpack_superblock",
]

HEADER_BYTES = 4096
"""Superblock and extent-header size (one page: aligned for O_DIRECT and atomic enough with a checksum)."""
RECORD_BYTES = 512
"""One index record per slot (one sector)."""
MIN_CLASS = 64 << 10
STEPS_PER_OCTAVE = 16
"""Slot classes: 16 sizes per power of two (at most 6.25 % of a slot unused), 4 KiB-aligned."""
VERSION = 1

_SB_MAGIC = b"TCSLAB01"
_SB = struct.Struct("<8sIIQQQQQIIQQ")  # magic ver rec cap D T n_ext min_class steps pad max_class format_id
_EXT_MAGIC = 0x45534354  # "TCSE"
_EXT = struct.Struct("<IHHQQIIQ")  # magic ver pad format_id gen extent pad class_size
_REC_MAGIC = 0x52534354  # "TCSR"
_REC = struct.Struct("<IHHQQQQQIIQHH")  # magic ver flags format gen seq len vhash ext slot class skew keylen
_HASH = struct.Struct("<Q")
_FLAG_VALID = 1


def align_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def bytes_text(n: int) -> str:
    """``n`` for a message: ``"1073741824 bytes (1.0 GiB)"``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.1f} {unit})"
    return f"{n} bytes"


def class_sizes(largest: int) -> list[int]:
    """Slot sizes from 64 KiB up to the first one >= ``largest``: 16 evenly spaced per power of two."""
    sizes: list[int] = []
    base = MIN_CLASS
    while True:
        for i in range(STEPS_PER_OCTAVE):
            size = base + i * (base // STEPS_PER_OCTAVE)
            sizes.append(size)
            if size >= largest:
                return sizes
        base *= 2


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where everything lives; computed from the options and stored in the superblock."""

    capacity: int
    extent_bytes: int  # D: data bytes per extent (>= the largest class)
    table_bytes: int  # T: extent header + one record per slot of the smallest class
    n_extents: int
    max_class: int

    @classmethod
    def plan(cls, capacity: int, max_class: int, extent_bytes: int | None) -> Geometry:
        """Cut ``capacity`` bytes into extents; ValueError if not even one extent fits."""
        if extent_bytes is None:
            extent_bytes = max(max_class, min(1 << 30, capacity // 32))
        extent_bytes = align_up(max(extent_bytes, max_class), 1 << 20)
        table = align_up(HEADER_BYTES + (extent_bytes // MIN_CLASS) * RECORD_BYTES, 4096)
        n = (capacity - HEADER_BYTES) // (table + extent_bytes)
        if n < 1:
            raise ValueError(
                f"capacity {capacity} is too small: one extent needs {HEADER_BYTES + table + extent_bytes} "
                f"bytes (the largest slot class is {max_class} bytes; lower max_object or extent_size)"
            )
        return cls(capacity, extent_bytes, table, n, max_class)

    @property
    def stride(self) -> int:
        return self.table_bytes + self.extent_bytes

    def table_offset(self, extent: int) -> int:
        return HEADER_BYTES + extent * self.stride

    def record_offset(self, extent: int, slot: int) -> int:
        return self.table_offset(extent) + HEADER_BYTES + slot * RECORD_BYTES

    def data_offset(self, extent: int, slot: int, class_size: int) -> int:
        return self.table_offset(extent) + self.table_bytes + slot * class_size

    def slots(self, class_size: int) -> int:
        return self.extent_bytes // class_size

    @property
    def used_bytes(self) -> int:
        """Bytes of the file that the layout covers."""
        return HEADER_BYTES + self.n_extents * self.stride


def _seal(body: bytes, size: int) -> bytes:
    out = bytearray(size)
    out[: len(body)] = body
    out[size - 8 :] = _HASH.pack(xxhash.xxh3_64_intdigest(bytes(out[: size - 8])))
    return bytes(out)


def _sealed(raw: bytes | memoryview, size: int) -> bool:
    if len(raw) < size:
        return False
    (h,) = _HASH.unpack_from(raw, size - 8)
    return bool(h == xxhash.xxh3_64_intdigest(bytes(raw[: size - 8])))


def pack_superblock(geo: Geometry, format_id: int) -> bytes:
    body = _SB.pack(
        _SB_MAGIC,
        VERSION,
        RECORD_BYTES,
        geo.capacity,
        geo.extent_bytes,
        geo.table_bytes,
        geo.n_extents,
        MIN_CLASS,
        STEPS_PER_OCTAVE,
        0,
        geo.max_class,
        format_id,
    )
    return _seal(body, HEADER_BYTES)


def unpack_superblock(raw: bytes) -> tuple[Geometry, int] | None:
    """(geometry, format_id) of a valid superblock, else None."""
    if len(raw) < HEADER_BYTES or raw[:8] != _SB_MAGIC or not _sealed(raw, HEADER_BYTES):
        return None
    _, ver, rec, cap, d, t, n, min_class, steps, _, max_class, fid = _SB.unpack_from(raw)
    if ver != VERSION or rec != RECORD_BYTES or min_class != MIN_CLASS or steps != STEPS_PER_OCTAVE:
        return None
    return Geometry(cap, d, t, n, max_class), fid


def pack_extent_header(format_id: int, gen: int, extent: int, class_size: int) -> bytes:
    return _seal(_EXT.pack(_EXT_MAGIC, VERSION, 0, format_id, gen, extent, 0, class_size), HEADER_BYTES)


def unpack_extent_header(raw: bytes, format_id: int, extent: int) -> tuple[int, int] | None:
    """(gen, class_size) of this slab's valid header for ``extent``, else None (a free extent)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, ver, _, fid, gen, ext, _, class_size = _EXT.unpack_from(raw)
    if magic != _EXT_MAGIC or ver != VERSION or fid != format_id or ext != extent:
        return None
    if not _sealed(raw, HEADER_BYTES):
        return None
    return gen, class_size


@dataclass(frozen=True, slots=True)
class Record:
    """A committed object: key, where its bytes are, their length and xxh3_64, and its commit sequence."""

    key: str
    gen: int
    seq: int
    length: int
    vhash: int
    extent: int
    slot: int
    class_size: int
    skew: int


def pack_record(format_id: int, r: Record) -> bytes:
    key = r.key.encode()
    body = _REC.pack(
        _REC_MAGIC,
        VERSION,
        _FLAG_VALID,
        format_id,
        r.gen,
        r.seq,
        r.length,
        r.vhash,
        r.extent,
        r.slot,
        r.class_size,
        r.skew,
        len(key),
    )
    return _seal(body + key, RECORD_BYTES)


def tombstone() -> bytes:
    """An all-zero record: no magic, so replay skips the slot."""
    return bytes(RECORD_BYTES)


def unpack_record(raw: bytes | memoryview, format_id: int) -> Record | None:
    """The record if it is valid for this slab (magic, version, checksum, key), else None."""
    if len(raw) < RECORD_BYTES:
        return None
    magic, ver, flags, fid, gen, seq, length, vhash, ext, slot, csize, skew, klen = _REC.unpack_from(raw)
    if magic != _REC_MAGIC or ver != VERSION or fid != format_id or not flags & _FLAG_VALID:
        return None
    if klen > 255 or _REC.size + klen > RECORD_BYTES - 8 or not _sealed(raw, RECORD_BYTES):
        return None
    try:
        key = bytes(raw[_REC.size : _REC.size + klen]).decode()
    except UnicodeDecodeError:
        return None
    return Record(key, gen, seq, length, vhash, ext, slot, csize, skew)


def class_index(sizes: list[int], need: int) -> int:
    """Index of the smallest class holding ``need`` bytes (len(sizes) if none does)."""
    return bisect.bisect_left(sizes, need)
