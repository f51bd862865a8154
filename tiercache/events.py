"""KV events: what each tier newly holds and drops, in the block hashes routers know (vLLM's KV events).

An :class:`EventSink` follows one storage manager: its L1 listener and its L2 store listener report which
tier holds which key; :meth:`EventSink.describe` tells it, before a store, which vLLM blocks a key covers.
Out come :class:`Stored` / :class:`Removed` / :class:`Cleared` events per medium, each block announced once
per medium however many keys or tiers of that medium hold it (reference counts), ready for vLLM's
``take_events`` or for :func:`encode_batch` (vLLM's ``KVEventBatch`` wire format, msgpack).

A key that was never described (token keys without vLLM block hashes, a chunk with no whole block, a key
another process stored) is tracked for resets but announces nothing.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache.store.manager import StorageManager

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_REMOTE",
    "BlockHash",
    "ChunkInfo",
    "Cleared",
    "Event",
    "EventSink",
    "ForwardingSink",
    "Removed",
    "Stored",
    "chunk_infos",
    "encode_batch",
    "external_hash",
    "medium_of",
]

MEDIUM_CPU = "CPU"
"""L1 (host memory) and in-memory tiers."""
MEDIUM_DISK = "DISK"
"""Local file tiers (POSIX directory, NVMe slab)."""
MEDIUM_REMOTE = "REMOTE"
"""Tiers on other hosts (Redis/Valkey, S3, Mooncake, third-party adapters)."""

_DISK_SCHEMES = ("file", "posix", "nvme+slab", "slab")
_CPU_SCHEMES = ("memory",)

_LOW64 = (1 << 64) - 1

BlockHash = bytes | int
"""A vLLM block hash as its events carry it: bytes, or their low 64 bits big-endian as an int (vLLM's
default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)."""


def medium_of(url: str) -> str:
    """The event medium of a tier from its URL's scheme: CPU (memory), DISK (file, slab) or REMOTE."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme in _CPU_SCHEMES:
        return MEDIUM_CPU
    if scheme in _DISK_SCHEMES:
        return MEDIUM_DISK
    return MEDIUM_REMOTE


def external_hash(block_hash: bytes, as_int: bool) -> BlockHash:
    """A vLLM block hash as vLLM's events carry it (``maybe_convert_block_hash``)."""
    if not as_int:
        return bytes(block_hash)
    return int.from_bytes(block_hash, byteorder="big") & _LOW64


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """The vLLM blocks one stored key covers: their hashes (whole blocks only), the hash before the first,
    their token ids, vLLM's block size and the request's LoRA adapter name."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks newly held by ``medium`` (vLLM's ``BlockStored``)."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks ``medium`` no longer holds (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """Everything announced before is gone (vLLM's ``AllBlocksCleared``)."""


Event = Stored | Removed | Cleared


def chunk_infos(
    tokens: Sequence[int],
    block_hashes: Sequence[bytes],
    block_size: int,
    spans: Iterable[tuple[int, int]],
    *,
    lora_name: str | None = None,
    int_hashes: bool = True,
) -> list[ChunkInfo | None]:
    """One :class:`ChunkInfo` per token span ``(start, end)`` of a request: the whole vLLM blocks inside it
    (None where it holds none, or its first block does not start on a block boundary). Token ids of a list
    whose first is a Python int are taken as they are; any other sequence's are converted with ``int``."""
    spans = list(spans)
    count = len(block_hashes)
    bounds = [
        (start // block_size, min(end // block_size, count), start % block_size) for start, end in spans
    ]
    wanted = [(first, last) for first, last, off in bounds if not off and last > first]
    if not wanted:
        return [None] * len(spans)
    base = max(min(first for first, _ in wanted) - 1, 0)  # the first block's parent too
    top = max(last for _, last in wanted)
    if int_hashes:  # each block converted once, however many spans share it
        ext: list[BlockHash] = [int.from_bytes(h, "big") & _LOW64 for h in block_hashes[base:top]]
    else:
        ext = [bytes(h) for h in block_hashes[base:top]]
    plain = isinstance(tokens, list | tuple) and bool(tokens) and type(tokens[0]) is int
    out: list[ChunkInfo | None] = []
    for first, last, off in bounds:
        if off or last <= first:
            out.append(None)
            continue
        parent = ext[first - 1 - base] if first else None
        span = tokens[first * block_size : last * block_size]
        toks = tuple(span) if plain else tuple(map(int, span))
        out.append(ChunkInfo(tuple(ext[first - base : last - base]), parent, toks, block_size, lora_name))
    return out


class EventSink:
    """Tier membership of keys, turned into per-medium block events (thread-safe; listeners call in from
    under the L1's lock, so nothing here calls back into a tier).

    ``media``: tier name -> medium (``"L1"`` -> CPU is implied). ``emit``: False keeps membership only (for
    resets) and queues no event. ``max_described``: keys whose block info is kept; ``max_held``: keys one L2
    tier is tracked holding (L1 is bounded by its capacity). Past either bound the oldest key is forgotten
    (counted in ``lost``): its blocks' counts drop silently, its removal is never announced and a reset no
    longer finds it."""

    describes_lookups = True
    """Whether an engine describes the chunks its lookups find (their prefetches into L1 are announced)."""

    def __init__(
        self,
        media: Mapping[str, str] | None = None,
        *,
        emit: bool = True,
        int_hashes: bool = True,
        max_described: int = 1 << 16,
        max_held: int = 1 << 20,
    ) -> None:
        self.media: dict[str, str] = {"L1": MEDIUM_CPU, **(media or {})}
        self.emit = emit
        self.int_hashes = int_hashes
        """Block hashes as ints (vLLM's default) or bytes, as :func:`external_hash` makes them."""
        self.max_described = max_described
        self.max_held = max_held
        self._lock = threading.Lock()
        self._info: OrderedDict[str, ChunkInfo] = OrderedDict()
        self._held: dict[str, dict[str, None]] = {}  # tier -> keys it holds (insertion-ordered set)
        self._counts: dict[str, dict[BlockHash, int]] = {}  # medium -> block -> keys holding it there
        self._queue: list[Event] = []
        self.lost = 0
        """Held keys forgotten past ``max_described`` or ``max_held``."""

    # ----- inputs ------------------------------------------------------------------------------------
    def describe(self, keys: Sequence[str], infos: Sequence[ChunkInfo | None]) -> None:
        """Which blocks each key covers (None: the key announces nothing). A key a tier already holds is
        announced now (a chunk another process stored, found by a lookup and prefetched)."""
        if not self.emit:
            return
        with self._lock:
            for key, info in zip(keys, infos, strict=True):
                if info is None:
                    continue
                known = key in self._info
                self._info[key] = info
                self._info.move_to_end(key)
                if not known:
                    for tier, held in self._held.items():
                        if key in held:
                            self._count(key, self.media.get(tier, MEDIUM_REMOTE), +1)
            while len(self._info) > self.max_described:
                old = next(iter(self._info))
                holders = [tier for tier, held in self._held.items() if old in held]
                for tier in holders:  # counts drop now: nothing could take them back later
                    self._count(old, self.media.get(tier, MEDIUM_REMOTE), -1, silent=True)
                self.lost += bool(holders)
                del self._info[old]

    def describe_request(
        self,
        keys: Sequence[str],
        tokens: Sequence[int],
        block_hashes: Sequence[bytes],
        block_size: int,
        spans: Sequence[tuple[int, int]],
        lora_name: str | None = None,
    ) -> None:
        """:meth:`describe` the keys of a request's token ``spans`` from its vLLM block hashes (keys already
        described are only marked recently used: a key names its blocks, so their description is the same)."""
        if not self.emit:
            return
        known = self._info
        new = [i for i, key in enumerate(keys) if key not in known]
        if len(new) < len(keys):
            with self._lock:
                for key in keys:
                    if key in known:
                        known.move_to_end(key)
            if not new:
                return
            keys, spans = [keys[i] for i in new], [spans[i] for i in new]
        infos = chunk_infos(
            tokens, block_hashes, block_size, spans, lora_name=lora_name, int_hashes=self.int_hashes
        )
        self.describe(keys, infos)

    def on_tier(self, tier: str, kind: str, keys: Sequence[str]) -> None:
        """``tier`` now holds (``kind == "stored"``) or no longer holds (any other kind) ``keys``."""
        with self._lock:
            held = self._held.setdefault(tier, {})
            medium = self.media.get(tier, MEDIUM_REMOTE)
            if kind == "stored":
                for key in keys:
                    if key not in held:
                        held[key] = None
                        self._count(key, medium, +1)
                while tier != "L1" and len(held) > self.max_held:
                    old = next(iter(held))
                    del held[old]
                    self._count(old, medium, -1, silent=True)
                    self.lost += 1
            else:
                for key in keys:
                    if held.pop(key, 0) is None:
                        self._count(key, medium, -1)

    def l1_listener(self, kind: str, keys: Sequence[str]) -> None:
        """An ``L1Cache.add_listener`` callback for this sink (tier ``"L1"``)."""
        self.on_tier("L1", kind, keys)

    def attach(self, manager: StorageManager) -> Callable[[], None]:
        """Follow ``manager``'s L1 (a local one: a server's shared L1 is the server's to announce), its L2
        stores, the evictions and deletes of the L2 adapters that report them (file, nvme+slab) and, when
        emitting, the expiries of those that announce them (Redis/Valkey with a ttl); returns a function
        that stops following."""
        removers: list[Callable[[], None]] = []
        add_listener = getattr(manager.l1, "add_listener", None)
        if callable(add_listener):
            removers.append(add_listener(self.l1_listener))
        for tier in manager.tiers:
            add_tier_listener = getattr(tier.adapter, "add_listener", None)
            if callable(add_tier_listener):
                removers.append(add_tier_listener(functools.partial(self.on_tier, tier.name)))
            add_expiry_listener = getattr(tier.adapter, "add_expiry_listener", None)
            if self.emit and callable(add_expiry_listener):  # a subscription to the backend: only for events
                removers.append(add_expiry_listener(functools.partial(self.on_tier, tier.name)))
        manager.store.listeners.append(self.on_tier)

        def detach() -> None:
            for remove in removers:
                remove()
            if self.on_tier in manager.store.listeners:
                manager.store.listeners.remove(self.on_tier)

        return detach

    def cleared(self) -> None:
        """Queue a :class:`Cleared` (after a reset removed everything announced)."""
        if self.emit:
            with self._lock:
                self._queue.append(Cleared())

    # ----- outputs -----------------------------------------------------------------------------------
    def held(self, tier: str, prefix: str = "") -> list[str]:
        """The keys ``tier`` holds as far as this sink saw (those starting with ``prefix``)."""
        with self._lock:
            return [k for k in self._held.get(tier, {}) if k.startswith(prefix)]

    def tiers(self) -> list[str]:
        """Tiers this sink has seen hold something."""
        with self._lock:
            return [t for t, keys in self._held.items() if keys]

    def take(self) -> list[Event]:
        """The events queued since the last call, in order."""
        with self._lock:
            out, self._queue = self._queue, []
            return out

    # ----- internals (lock held) ---------------------------------------------------------------------
    def _count(self, key: str, medium: str, delta: int, *, silent: bool = False) -> None:
        """Count ``key``'s blocks on ``medium`` up (``delta`` 1) or down (-1); queue those that appear or
        go."""
        info = self._info.get(key)
        if info is None:
            return
        counts = self._counts.get(medium)
        if counts is None:
            counts = self._counts[medium] = {}
        hashes = info.block_hashes
        changed: list[int] = []  # indexes into hashes of the blocks that appear or go on this medium
        get = counts.get
        if delta > 0:
            for i, h in enumerate(hashes):
                before = get(h, 0)
                counts[h] = before + 1
                if not before:
                    changed.append(i)
        else:
            for i, h in enumerate(hashes):
                before = get(h, 0)
                if before > 1:
                    counts[h] = before - 1
                elif before == 1:
                    del counts[h]
                    changed.append(i)
        if not changed or not self.emit or silent:
            return
        if len(changed) == len(hashes):  # the whole chunk (the usual case): its own tuples, no copies
            if delta < 0:
                self._queue.append(Removed(hashes, medium))
            else:
                size = info.block_size
                self._queue.append(Stored(hashes, info.parent, info.token_ids, size, medium, info.lora_name))
            return
        if delta < 0:
            self._queue.append(Removed(tuple(hashes[i] for i in changed), medium))
            return
        run_start = 0
        for j in range(1, len(changed) + 1):  # one Stored per contiguous run of new blocks
            if j < len(changed) and changed[j] == changed[j - 1] + 1:
                continue
            first, last = changed[run_start], changed[j - 1] + 1
            parent = hashes[first - 1] if first else info.parent
            size = info.block_size
            tokens = info.token_ids[first * size : last * size]
            self._queue.append(Stored(hashes[first:last], parent, tokens, size, medium, info.lora_name))
            run_start = j


class ForwardingSink(EventSink):
    """A sink that only forwards descriptions to ``target`` (a client of a server that publishes the events:
    ``SharedL1.describe``); it tracks and queues nothing itself."""

    describes_lookups = False  # a lookup would cost a round trip to the server: stores only

    def __init__(
        self, target: Callable[[Sequence[str], Sequence[ChunkInfo | None]], None], *, int_hashes: bool = True
    ) -> None:
        super().__init__(int_hashes=int_hashes, max_described=0)
        self.target = target

    def describe(self, keys: Sequence[str], infos: Sequence[ChunkInfo | None]) -> None:
        """Forward to ``target`` (its failures are the target's to count: events are best effort)."""
        self.target(keys, infos)


def _event_map(event: Event) -> dict[str, Any]:
    """One event as msgspec encodes vLLM's tagged struct (a map, ``type`` first, defaults omitted)."""
    if isinstance(event, Stored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    if isinstance(event, Removed):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(
    events: Sequence[Event], ts: float | None = None, data_parallel_rank: int | None = None
) -> bytes:
    """``events`` as vLLM's ``KVEventBatch`` (msgpack, ``[ts, events, data_parallel_rank]``): what its
    ``ZmqEventPublisher`` sends as the payload frame after the topic and the 8-byte sequence number."""
    import msgpack  # here, not at import: the connector runs in process without it

    body = [time.time() if ts is None else ts, [_event_map(e) for e in events], data_parallel_rank]
    return bytes(msgpack.packb(body, use_bin_type=True))
