"""Eviction orders: which cached key goes next. ``lru`` (least recently used) and ``s3fifo`` (S3-FIFO: a
small probationary FIFO, a main FIFO with reinsertion, a ghost list of recently evicted keys), the
scan-resistant choice: a key seen once leaves from the small queue without disturbing the keys in main.

A policy only orders keys; the cache owns the data. The cache calls :meth:`insert` when a key becomes
visible (``reused=True`` when it already has evidence the key will be read again), :meth:`touch` on a read,
:meth:`remove` when it drops a key itself, and :meth:`victim` for room, passing ``evictable`` (False for
leased, pinned or, under a quota, other tenants' keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "LRUPolicy", "S3FIFOPolicy", "make_policy"]

EVICTION_POLICIES = ("lru", "s3fifo")
"""Names :func:`make_policy` accepts (the values of ``l1.eviction`` and the disk adapters' ``eviction``)."""


class EvictionPolicy(Protocol):
    """An order over the keys a cache holds; weights are bytes or slots, as the cache counts."""

    def insert(self, key: str, weight: int = 1, reused: bool = False) -> None:
        """``key`` is now held (not held before); ``reused``: evidence that it will be read again."""

    def touch(self, key: str) -> None:
        """``key`` was read (ignored when not held)."""

    def remove(self, key: str) -> None:
        """``key`` left without being chosen (ignored when not held)."""

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        """The next key to evict among those ``evictable`` allows, already forgotten by the policy; None
        when no held key qualifies."""

    def __len__(self) -> int:
        """Keys held."""

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held."""

    def __iter__(self) -> Iterator[str]:
        """Held keys, next victim first when nothing is protected (approximately, for ``s3fifo``)."""


class LRUPolicy:
    """Least recently used first; a read makes a key most recent."""

    def __init__(self) -> None:
        """An empty order."""
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str, weight: int = 1, reused: bool = False) -> None:
        """Most recent (``reused`` changes nothing)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        """Most recent, when held."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        """Forget ``key``."""
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        """The least recent evictable key."""
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        """Keys held."""
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        """Whether held."""
        return key in self._order

    def __iter__(self) -> Iterator[str]:
        """Least recent first."""
        return iter(list(self._order))


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023). New keys enter a small FIFO (``small_share`` of ``capacity``); a
    key read while there moves to the main FIFO when it reaches the small queue's head, an unread one is
    evicted and remembered in the ghost list; a ghost key inserted again goes straight to main. Main evicts
    from its head, giving a key read since its last pass another round (reads count up to 3). The ghost list
    holds 4x as many keys as the cache (the paper: 1x), so a scan longer than the cache does not flush
    the ghosts of chunks a conversation's next turn comes back for. A key inserted with ``reused`` (the
    cache knows it continues a sequence that came back) goes to main like a ghost."""

    def __init__(self, capacity: int | None, small_share: float = 0.1, ghosts: float = 4.0) -> None:
        """``capacity`` in the cache's weight units (slots or bytes; None: whatever is held, for a cache
        whose room changes); the ghost list remembers ``ghosts`` times as many keys as are held. ValueError
        when out of range."""
        if capacity is not None and capacity <= 0:
            raise ValueError(f"s3fifo capacity must be positive: {capacity}")
        if not 0 < small_share < 1:
            raise ValueError(f"s3fifo small_share must be in (0, 1): {small_share}")
        if ghosts < 0:
            raise ValueError(f"s3fifo ghosts must be >= 0: {ghosts}")
        self.capacity = capacity
        self.ghosts = ghosts
        self._small_share = small_share
        self._small_target = 0 if capacity is None else max(1, int(capacity * small_share))
        self._small: OrderedDict[str, int] = OrderedDict()  # key -> weight, oldest first
        self._main: OrderedDict[str, int] = OrderedDict()
        self._main_w = 0
        self._freq: dict[str, int] = {}
        self._small_w = 0
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self.promotions = 0
        """Keys moved from the small queue to main."""

    def insert(self, key: str, weight: int = 1, reused: bool = False) -> None:
        """Into main when the ghost list remembers ``key`` or it is ``reused``, else into the small queue."""
        self.remove(key)
        self._freq[key] = 0
        if reused or key in self._ghost:
            self._ghost.pop(key, None)
            self._main[key] = weight
            self._main_w += weight
        else:
            self._small[key] = weight
            self._small_w += weight

    def touch(self, key: str) -> None:
        """One more read (saturating at 3)."""
        f = self._freq.get(key)
        if f is not None and f < 3:
            self._freq[key] = f + 1

    def remove(self, key: str) -> None:
        """Forget ``key`` (not remembered as a ghost)."""
        if self._freq.pop(key, None) is None:
            return
        w = self._small.pop(key, None)
        if w is not None:
            self._small_w -= w
        else:
            self._main_w -= self._main.pop(key)

    def _remember(self, key: str) -> None:
        ghost = self._ghost
        ghost[key] = None
        while len(ghost) > max(int(self.ghosts * len(self._freq)), 1):
            ghost.popitem(last=False)

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        """Small queue first while it holds its share (or main is empty), else main; keys ``evictable``
        refuses go to the back of their queue, and each queue is given up after one full pass of them."""
        small, main, freq = self._small, self._main, self._freq
        stuck_small = stuck_main = 0  # consecutive refused keys per queue
        main_rounds = 4 * len(main) + len(small) + 1  # reinsertions are bounded by the read counts
        target = self._small_target or max(1, int((self._small_w + self._main_w) * self._small_share))
        while True:
            small_ok = small and stuck_small < len(small)
            main_ok = main and stuck_main < len(main) and main_rounds > 0
            if small_ok and (self._small_w >= target or not main_ok):
                key = next(iter(small))
                if freq[key] > 0:  # read while on probation: promote
                    w = small.pop(key)
                    self._small_w -= w
                    main[key] = w
                    self._main_w += w
                    freq[key] = 0
                    self.promotions += 1
                    stuck_small = 0
                    main_rounds += 1
                    continue
                if not evictable(key):
                    small.move_to_end(key)
                    stuck_small += 1
                    continue
                self._small_w -= small.pop(key)
                del freq[key]
                self._remember(key)
                return key
            if not main_ok:
                return None
            main_rounds -= 1
            key = next(iter(main))
            if freq[key] > 0:
                freq[key] -= 1
                main.move_to_end(key)
                stuck_main = 0
                continue
            if not evictable(key):
                main.move_to_end(key)
                stuck_main += 1
                continue
            self._main_w -= main.pop(key)
            del freq[key]
            return key

    def __len__(self) -> int:
        """Keys held."""
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        """Whether held."""
        return key in self._freq

    def __iter__(self) -> Iterator[str]:
        """Small queue then main, each oldest first."""
        return iter([*self._small, *self._main])


def make_policy(name: str, capacity: int | None, **options: float) -> EvictionPolicy:
    """The policy called ``name`` for a cache of ``capacity`` weight units (``options``: S3-FIFO's
    ``small_share``, ``ghosts``); ValueError naming the choices."""
    if name == "lru":
        return LRUPolicy()
    if name == "s3fifo":
        return S3FIFOPolicy(capacity, **options)
    raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, not {name!r}")
