"""The shared L1 memory: a data memfd split into equal regions (each carved into slots of one size class
when a class needs it), and a header memfd (epoch + per-slot generation and state) that the server writes
and clients map read-only to validate a slot without an RPC.

Both memfds are sealed against shrinking and growing (no client can make the server or another client take a
SIGBUS), and the header is sealed against new writable mappings (``F_SEAL_FUTURE_WRITE``): a client can map it
read-only only. Slot ids are ``region * slots_per_region + index``; a slot's byte offset travels with every
reference the server hands out, so clients need no knowledge of the classes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec
    from tiercache.store.l1 import ObjectState

__all__ = [
    "FREE",
    "MIN_SLOT",
    "PUBLISHED",
    "RESERVED",
    "SLOT_ALIGN",
    "Geometry",
    "Segment",
    "SlotObject",
    "default_region_bytes",
    "stride_of",
]

SLOT_ALIGN = 64  # every slot starts on a cache line
MIN_SLOT = 4096  # smallest slot stride; a region has at most region_bytes // MIN_SLOT slot ids
MAX_SLOT_IDS_PER_REGION = 65536  # bounds the header: larger regions get a larger smallest stride
FREE, RESERVED, PUBLISHED = 0, 1, 2
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; not exported by Python's fcntl


def stride_of(nbytes: int) -> int:
    """Bytes a slot of ``nbytes`` takes in a region (rounded up to SLOT_ALIGN)."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def default_region_bytes(capacity: int, largest_slot: int = 0) -> int:
    """The region size for a segment of ``capacity`` bytes: capacity / 16 within [64 MiB, 1 GiB], at least one
    slot of ``largest_slot``, at most the capacity; a multiple of MIN_SLOT."""
    region = min(max(capacity // 16, 64 << 20), 1 << 30)
    region = max(region, stride_of(largest_slot))
    region = min(region, capacity)
    return max(MIN_SLOT, region // MIN_SLOT * MIN_SLOT)


@dataclass(frozen=True, slots=True)
class Geometry:
    """How the data memfd is divided: ``num_regions`` regions of ``region_bytes``, each with up to
    ``slots_per_region`` slot ids (header rows)."""

    region_bytes: int
    num_regions: int

    def __post_init__(self) -> None:
        if self.region_bytes < MIN_SLOT or self.region_bytes % SLOT_ALIGN or self.num_regions <= 0:
            raise ValueError(
                f"a segment needs at least one region of at least {MIN_SLOT} bytes (a multiple of "
                f"{SLOT_ALIGN}): {self.num_regions} x {self.region_bytes}"
            )

    @classmethod
    def for_capacity(cls, capacity: int, region_bytes: int | None = None, largest_slot: int = 0) -> Geometry:
        """As many whole regions as ``capacity`` holds (region size: ``region_bytes`` or the default)."""
        region = region_bytes or default_region_bytes(capacity, largest_slot)
        return cls(region, max(1, capacity // region) if region <= capacity else 0)

    @property
    def min_stride(self) -> int:
        """The smallest slot stride (bounds the slot ids of a region)."""
        return max(MIN_SLOT, -(-self.region_bytes // MAX_SLOT_IDS_PER_REGION // SLOT_ALIGN) * SLOT_ALIGN)

    @property
    def slots_per_region(self) -> int:
        """Slot ids reserved for each region."""
        return self.region_bytes // self.min_stride

    @property
    def num_slot_ids(self) -> int:
        """Rows of the header table."""
        return self.num_regions * self.slots_per_region

    @property
    def data_bytes(self) -> int:
        """Bytes of the data memfd."""
        return self.num_regions * self.region_bytes

    @property
    def header_bytes(self) -> int:
        """Bytes of the header memfd (epoch, then [generation, state] per slot id; sparse until touched)."""
        return 8 * (1 + 2 * self.num_slot_ids)


def _sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes that can never shrink or grow (seals added, then the seal set itself sealed
    by the caller once nothing more is to be added)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Segment:
    """Mapped data + header of one server epoch."""

    def __init__(self, geometry: Geometry, data_fd: int, header_fd: int, *, writable_header: bool) -> None:
        """Map both fds (the caller keeps ownership of the fds)."""
        self.geometry = geometry
        self.data_bytes = geometry.data_bytes
        self.data = mmap.mmap(data_fd, self.data_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable_header else 0)
        self._header_map = mmap.mmap(header_fd, geometry.header_bytes, mmap.MAP_SHARED, prot)
        header = np.frombuffer(self._header_map, dtype=np.int64)
        self.epoch_cell = header[:1]
        self.table = header[1:].reshape(geometry.num_slot_ids, 2)  # [generation, state]
        self.view = memoryview(self.data)
        self._views: dict[int, tuple[KVSpec, int, torch.Tensor]] = {}  # slot -> its last typed view
        self.cuda_register_s: float | None = None
        """Seconds a client's ``cudaHostRegister`` of ``data`` took (None: not registered)."""

    @classmethod
    def create(cls, geometry: Geometry, epoch: int) -> tuple[Segment, int, int]:
        """New sealed memfds for ``geometry``; returns the segment and its (data_fd, header_fd). The header is
        mapped writable here, then sealed so that no one else can ever map it writable."""
        data_fd = _sealed_memfd("tiercache-l1", geometry.data_bytes)
        try:
            fcntl.fcntl(data_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
            header_fd = _sealed_memfd("tiercache-l1-header", geometry.header_bytes)
        except BaseException:
            os.close(data_fd)
            raise
        try:
            seg = cls(geometry, data_fd, header_fd, writable_header=True)
            fcntl.fcntl(header_fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(data_fd)
            os.close(header_fd)
            raise
        seg.epoch_cell[0] = epoch
        return seg, data_fd, header_fd

    def slot_state(self, slot: int) -> tuple[int, int]:
        """(generation, state) of ``slot`` as the header says now."""
        row = self.table[slot]
        return int(row[0]), int(row[1])

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` at ``offset`` of the data (no copy)."""
        return self.view[offset : offset + nbytes]

    def typed_view(self, slot: int, offset: int, spec: KVSpec) -> torch.Tensor:
        """A no-copy tensor at ``offset`` shaped ``spec.shape`` with the spec's dtype. The slot keeps its last
        view and hands the same tensor out again while spec and offset repeat (as the in-process L1 does):
        never reshape it in place."""
        kept = self._views.get(slot)
        if kept is not None and kept[1] == offset and (kept[0] is spec or kept[0] == spec):
            return kept[2]
        import torch

        raw = torch.frombuffer(self.buffer(offset, spec.nbytes), dtype=torch.uint8)
        view = raw.view(getattr(torch, spec.dtype)).view(spec.shape)
        self._views[slot] = (spec, offset, view)
        return view

    def release_views(self) -> None:
        """Forget the kept typed views (the mapping goes away once nothing else uses it)."""
        self._views.clear()


class SlotObject:
    """A slot of a segment holding ``spec`` at generation ``gen`` and byte ``offset`` (WRITING after a
    reservation, READY when published); no-copy views of its memory."""

    __slots__ = ("gen", "key", "offset", "seg", "slot", "spec", "state")

    def __init__(
        self, seg: Segment, key: str, spec: KVSpec, slot: int, gen: int, offset: int, state: ObjectState
    ):
        self.seg = seg
        self.key = key
        self.spec = spec
        self.slot = slot
        self.gen = gen
        self.offset = offset
        self.state = state

    def published(self) -> bool:
        """Whether the segment's header shows the slot PUBLISHED at this object's generation (still it)."""
        return self.seg.slot_state(self.slot) == (self.gen, PUBLISHED)

    def buffer(self) -> memoryview:
        """A writable uint8 view of exactly ``spec.nbytes`` bytes of the slot (no copy)."""
        return self.seg.buffer(self.offset, self.spec.nbytes)

    def tensor(self) -> torch.Tensor:
        """A no-copy view shaped ``spec.shape`` with the spec's dtype on the slot's memory (the slot's kept
        view: ``Segment.typed_view``)."""
        return self.seg.typed_view(self.slot, self.offset, self.spec)

    def __repr__(self) -> str:
        """Debug representation."""
        name = type(self).__name__
        return f"{name}(key={self.key!r}, state={self.state.name}, slot={self.slot}, gen={self.gen})"
