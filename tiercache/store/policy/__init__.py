"""Cache policies: eviction orders (``lru``, ``s3fifo``), frequency admission, per-tenant quotas and bounded
tenant labels, and the hit-rate ceiling estimate."""

from __future__ import annotations

from tiercache.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from tiercache.store.policy.ceiling import HitRateCeiling, HyperLogLog
from tiercache.store.policy.quotas import OTHER, TenantLabels, TenantQuotas, TierLedger, tenant_id
from tiercache.store.policy.sketch import Admission, FrequencySketch

__all__ = [
    "EVICTION_POLICIES",
    "OTHER",
    "Admission",
    "EvictionPolicy",
    "FrequencySketch",
    "HitRateCeiling",
    "HyperLogLog",
    "LRUPolicy",
    "S3FIFOPolicy",
    "TenantLabels",
    "TenantQuotas",
    "TierLedger",
    "make_policy",
    "tenant_id",
]
