"""The shared L1 memory: a data memfd carved into slot classes, and a header memfd (epoch + per-slot
generation and state) that the server writes and clients map read-only to validate a slot without an RPC.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec
    from tiercache.store.l1 import ObjectState

__all__ = ["FREE", "PUBLISHED", "RESERVED", "SLOT_ALIGN", "Segment", "SlotClass", "SlotObject"]

SLOT_ALIGN = 64  # every slot starts on a cache line
FREE, RESERVED, PUBLISHED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class SlotClass:
    """``count`` slots of ``slot_bytes`` each (stride rounded up to SLOT_ALIGN)."""

    slot_bytes: int
    count: int

    @property
    def stride(self) -> int:
        """Bytes between consecutive slots of this class."""
        return -(-self.slot_bytes // SLOT_ALIGN) * SLOT_ALIGN


class Segment:
    """Mapped data + header of one server epoch. Slots are numbered across classes in order."""

    def __init__(
        self, classes: Sequence[SlotClass], data_fd: int, header_fd: int, *, writable_header: bool
    ) -> None:
        """Map both fds (the caller keeps ownership of the fds)."""
        if not classes or any(c.slot_bytes <= 0 or c.count <= 0 for c in classes):
            raise ValueError(f"slot classes must be non-empty with positive sizes: {classes}")
        self.classes = tuple(classes)
        self.num_slots = sum(c.count for c in classes)
        self.offsets: list[int] = []
        self.capacities: list[int] = []
        self.class_of: list[int] = []
        off = 0
        for ci, c in enumerate(classes):
            for _ in range(c.count):
                self.offsets.append(off)
                self.capacities.append(c.slot_bytes)
                self.class_of.append(ci)
                off += c.stride
        self.data_bytes = off
        self.header_bytes = 8 * (1 + 2 * self.num_slots)
        self.data = mmap.mmap(data_fd, self.data_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable_header else 0)
        self._header_map = mmap.mmap(header_fd, self.header_bytes, mmap.MAP_SHARED, prot)
        header = np.frombuffer(self._header_map, dtype=np.int64)
        self.epoch_cell = header[:1]
        self.table = header[1:].reshape(self.num_slots, 2)  # [generation, state]
        self.view = memoryview(self.data)
        self._views: list[tuple[KVSpec, torch.Tensor] | None] = [None] * self.num_slots  # each slot's last
        self.cuda_register_s: float | None = None
        """Seconds a client's ``cudaHostRegister`` of ``data`` took (None: not registered)."""

    @classmethod
    def create(cls, classes: Sequence[SlotClass], epoch: int) -> tuple[Segment, int, int]:
        """New memfds sized for ``classes``; returns the segment and its (data_fd, header_fd)."""
        data_fd = os.memfd_create("tiercache-l1", os.MFD_CLOEXEC)
        header_fd = os.memfd_create("tiercache-l1-header", os.MFD_CLOEXEC)
        try:
            total = sum(c.stride * c.count for c in classes)
            os.ftruncate(data_fd, total)
            os.ftruncate(header_fd, 8 * (1 + 2 * sum(c.count for c in classes)))
            seg = cls(classes, data_fd, header_fd, writable_header=True)
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

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` of ``slot`` (no copy)."""
        off = self.offsets[slot]
        return self.view[off : off + nbytes]

    def typed_view(self, slot: int, spec: KVSpec) -> torch.Tensor:
        """A no-copy tensor on ``slot`` shaped ``spec.shape`` with the spec's dtype. The slot keeps its last
        view and hands the same tensor out again while the spec repeats (as the in-process L1 does): never
        reshape it in place."""
        kept = self._views[slot]
        if kept is not None and (kept[0] is spec or kept[0] == spec):
            return kept[1]
        import torch

        raw = torch.frombuffer(self.buffer(slot, spec.nbytes), dtype=torch.uint8)
        view = raw.view(getattr(torch, spec.dtype)).view(spec.shape)
        self._views[slot] = (spec, view)
        return view


class SlotObject:
    """A slot of a segment holding ``spec`` at generation ``gen`` (WRITING after a reservation, READY when
    published); no-copy views of its memory."""

    __slots__ = ("gen", "key", "seg", "slot", "spec", "state")

    def __init__(self, seg: Segment, key: str, spec: KVSpec, slot: int, gen: int, state: ObjectState):
        self.seg = seg
        self.key = key
        self.spec = spec
        self.slot = slot
        self.gen = gen
        self.state = state

    def buffer(self) -> memoryview:
        """A writable uint8 view of exactly ``spec.nbytes`` bytes of the slot (no copy)."""
        return self.seg.buffer(self.slot, self.spec.nbytes)

    def tensor(self) -> torch.Tensor:
        """A no-copy view shaped ``spec.shape`` with the spec's dtype on the slot's memory (the slot's kept
        view: ``Segment.typed_view``)."""
        return self.seg.typed_view(self.slot, self.spec)

    def __repr__(self) -> str:
        """Debug representation."""
        name = type(self).__name__
        return f"{name}(key={self.key!r}, state={self.state.name}, slot={self.slot}, gen={self.gen})"
