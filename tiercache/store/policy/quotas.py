"""Per-tenant byte budgets and bounded tenant labels. A tenant is named by :func:`tenant_id` of the
``cache_salt`` a request carries ("" for none), and of its LoRA adapter's name where tenants are told apart by
adapter too (``l1.tenant_by = "salt+lora"``); a budget of 0 means unlimited. :class:`TenantLabels` caps
the label set of tenant metrics: the first ``max_labels`` tenants keep their name, the rest count under
``"other"``."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

__all__ = ["OTHER", "TenantLabels", "TenantQuotas", "TierLedger", "tenant_id"]

OTHER = "other"
"""The label of every tenant past the cap."""


@functools.lru_cache(maxsize=4096)
def tenant_id(salt: str, lora: str = "") -> str:
    """The tenant a ``cache_salt`` (and a LoRA adapter name, when tenants are told apart by adapter) stands
    for in quotas and metrics: ``"t-"`` + 16 hex digits of their SHA-256 (neither appears), "" for neither.
    Without ``lora`` the id is the salt's alone."""
    if not salt and not lora:
        return ""
    if not lora:
        data = b"tiercache-tenant\0" + salt.encode()
    else:  # the salt's length first: no salt and adapter name pair reads as another
        raw = salt.encode()
        data = b"tiercache-tenant-lora\0" + len(raw).to_bytes(8, "big") + raw + lora.encode()
    return "t-" + hashlib.sha256(data).hexdigest()[:16]


class TenantQuotas:
    """Bytes each tenant may hold in one tier, and what each holds. Not locked: the owning cache's lock
    guards it."""

    def __init__(self, budgets: Mapping[str, int] | None = None, default: int = 0) -> None:
        """``budgets``: tenant -> bytes; ``default`` for the rest (0: unlimited). ValueError on negatives."""
        for tenant, b in (budgets or {}).items():
            if b < 0:
                raise ValueError(f"quota of tenant {tenant!r} must be >= 0: {b}")
        if default < 0:
            raise ValueError(f"default quota must be >= 0: {default}")
        self.budgets = dict(budgets or {})
        self.default = default
        self.held: dict[str, int] = {}
        self.enabled = bool(self.default or any(self.budgets.values()))
        """Whether any tenant has a budget."""

    def budget(self, tenant: str) -> int:
        """``tenant``'s budget in bytes (0: unlimited)."""
        return self.budgets.get(tenant, self.default)

    def over(self, tenant: str, nbytes: int) -> bool:
        """Whether holding ``nbytes`` more would take ``tenant`` past its budget."""
        b = self.budget(tenant)
        return b > 0 and self.held.get(tenant, 0) + nbytes > b

    def add(self, tenant: str, nbytes: int) -> None:
        """``tenant`` holds ``nbytes`` more (or fewer, when negative)."""
        held = self.held.get(tenant, 0) + nbytes
        if held:
            self.held[tenant] = held
        else:
            self.held.pop(tenant, None)


class TierLedger:
    """Per-tenant quotas of one L2 tier over what this process stored there: each tenant's keys, oldest
    first, with their sizes. A tenant whose next object would pass its budget gives up its oldest keys
    (:meth:`make_room` names them, to delete first). Objects the backend drops by itself stay counted until
    they are found gone, so a tenant may give up keys early, never hold more than its budget. Not locked:
    used on the event loop."""

    def __init__(self, budgets: Mapping[str, int] | None = None, default: int = 0) -> None:
        """Budgets as :class:`TenantQuotas` takes them."""
        self.quotas = TenantQuotas(budgets, default)
        self._keys: dict[str, OrderedDict[str, int]] = {}  # tenant -> key -> bytes, oldest first
        self._tenant: dict[str, str] = {}  # key -> tenant

    def make_room(self, tenant: str, key: str, nbytes: int) -> list[str] | None:
        """Count ``nbytes`` under ``key`` for ``tenant``; the tenant's older keys to delete first so it stays
        within its budget (forgotten here), or None (nothing counted) when ``nbytes`` alone is over it."""
        budget = self.quotas.budget(tenant)
        if budget and nbytes > budget:
            return None
        self.forget(key)
        own = self._keys.setdefault(tenant, OrderedDict())
        victims: list[str] = []
        while self.quotas.over(tenant, nbytes) and own:
            old, size = own.popitem(last=False)
            del self._tenant[old]
            self.quotas.add(tenant, -size)
            victims.append(old)
        own[key] = nbytes
        self._tenant[key] = tenant
        self.quotas.add(tenant, nbytes)
        return victims

    def restore(self, entries: Iterable[tuple[str, str, int]]) -> None:
        """Count ``(key, tenant, bytes)`` the tier held before this process, oldest first, as older than
        anything counted already (keys counted already are skipped). A tenant over its budget now gives up
        its oldest keys at its next store."""
        fresh: dict[str, list[tuple[str, int]]] = {}
        for key, tenant, nbytes in entries:
            if key not in self._tenant:
                self._tenant[key] = tenant
                fresh.setdefault(tenant, []).append((key, nbytes))
                self.quotas.add(tenant, nbytes)
        for tenant, rows in fresh.items():
            own = self._keys.setdefault(tenant, OrderedDict())
            for key, nbytes in reversed(rows):
                own[key] = nbytes
                own.move_to_end(key, last=False)

    def forget(self, key: str) -> None:
        """``key`` is gone from the tier (or never landed)."""
        tenant = self._tenant.pop(key, None)
        if tenant is None:
            return
        own = self._keys[tenant]
        self.quotas.add(tenant, -own.pop(key))
        if not own:
            del self._keys[tenant]

    def held(self, tenant: str) -> int:
        """Bytes counted for ``tenant``."""
        return self.quotas.held.get(tenant, 0)


class TenantLabels:
    """Metric label of each tenant: its name for the first ``max_labels`` seen, ``"other"`` after.
    Thread-safe."""

    def __init__(self, max_labels: int = 32) -> None:
        """ValueError when ``max_labels`` is negative."""
        if max_labels < 0:
            raise ValueError(f"max_labels must be >= 0: {max_labels}")
        self.max_labels = max_labels
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant: str) -> str:
        """``tenant`` itself ("default" for "") while the set has room or it is known, else ``"other"``."""
        name = tenant or "default"
        if name in self._known:
            return name
        with self._lock:
            if name in self._known:
                return name
            if len(self._known) < self.max_labels and name != OTHER:
                self._known.add(name)
                return name
        return OTHER
