"""Cache policies: eviction orders against a model (every victim is held and evictable, none is missed),
S3-FIFO's scan resistance, the frequency sketch never undercounting, admission thresholds, the HyperLogLog
and hit-rate ceiling within their error, tenant quotas and bounded labels."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiercache.store.policy import (
    OTHER,
    Admission,
    FrequencySketch,
    HitRateCeiling,
    HyperLogLog,
    LRUPolicy,
    S3FIFOPolicy,
    TenantLabels,
    TenantQuotas,
    make_policy,
)

KEYS = st.sampled_from([f"k{i}" for i in range(12)])


class PolicyMachine(RuleBasedStateMachine):
    """Any op sequence: victims are held keys the predicate allows; None only when no held key is allowed;
    the policy holds exactly the model's keys."""

    @initialize(name=st.sampled_from(["lru", "s3fifo"]), capacity=st.none() | st.integers(1, 10))
    def setup(self, name: str, capacity: int | None) -> None:
        self.policy = make_policy(name, capacity)
        self.held: set[str] = set()
        self.blocked: set[str] = set()

    @rule(key=KEYS, weight=st.integers(1, 3))
    def insert(self, key: str, weight: int) -> None:
        if key not in self.held:
            self.policy.insert(key, weight)
            self.held.add(key)

    @rule(key=KEYS)
    def touch(self, key: str) -> None:
        self.policy.touch(key)

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        self.policy.remove(key)
        self.held.discard(key)

    @rule(key=KEYS)
    def block(self, key: str) -> None:
        self.blocked ^= {key}

    @rule()
    def victim(self) -> None:
        v = self.policy.victim(lambda k: k not in self.blocked)
        allowed = self.held - self.blocked
        if v is None:
            assert not allowed, f"no victim though {sorted(allowed)} may go"
        else:
            assert v in allowed
            self.held.discard(v)

    @invariant()
    def same_keys(self) -> None:
        assert sorted(self.policy) == sorted(self.held)
        assert len(self.policy) == len(self.held)
        assert all(k in self.policy for k in self.held)


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def _replay(policy_name: str, capacity: int, seed: int = 1) -> tuple[int, int]:
    """Hits on a reused working set of capacity/2 keys while a scan of one-off keys streams by."""
    rng = random.Random(seed)
    policy = make_policy(policy_name, capacity)
    held: set[str] = set()
    hot = [f"hot{i}" for i in range(capacity // 2)]
    hits = lookups = 0
    for step in range(20 * capacity):
        for key in (rng.choice(hot), *(f"scan{step}.{j}" for j in range(4))):
            if key.startswith("hot"):
                lookups += 1
            if key in held:
                hits += key.startswith("hot")
                policy.touch(key)
                continue
            if len(held) >= capacity:
                v = policy.victim(lambda k: True)
                assert v is not None
                held.discard(v)
            policy.insert(key)
            held.add(key)
    return hits, lookups


def test_s3fifo_keeps_a_working_set_through_a_scan_that_flushes_lru() -> None:
    lru_hits, lookups = _replay("lru", 100)
    s3_hits, _ = _replay("s3fifo", 100)
    assert s3_hits > 0.8 * lookups
    assert s3_hits > 2 * lru_hits


def test_s3fifo_ghost_readmits_to_main() -> None:
    p = S3FIFOPolicy(10)
    p.insert("a")
    assert p.victim(lambda k: True) == "a"  # unread: leaves from the small queue, remembered
    p.insert("a")
    for k in "bcdefgh":
        p.insert(k)
    assert p.victim(lambda k: True) == "b"  # a sits in main now; the small queue goes first
    assert list(p)[-1] == "a"


def test_s3fifo_promotes_a_read_key() -> None:
    p = S3FIFOPolicy(10)
    p.insert("a")
    p.insert("b")
    p.touch("a")
    assert p.victim(lambda k: True) == "b"
    assert p.promotions == 1
    assert "a" in p


def test_lru_order() -> None:
    p = LRUPolicy()
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.victim(lambda k: True) == "b"
    assert p.victim(lambda k: k != "c") == "a"


def test_make_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="lru, s3fifo"):
        make_policy("arc", 10)
    with pytest.raises(ValueError, match="capacity"):
        S3FIFOPolicy(0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=400), st.sampled_from([16, 64, 1024]))
def test_sketch_never_undercounts(seq: list[int], width: int) -> None:
    sk = FrequencySketch(width)
    truth: dict[int, int] = {}
    for x in seq:
        truth[x] = truth.get(x, 0) + 1
        assert sk.add(str(x)) >= min(truth[x], 15) or sk._added < len(truth)  # halving may have happened
    if len(seq) < sk.sample:
        for x, n in truth.items():
            assert sk.estimate(str(x)) >= min(n, 15)


def test_sketch_halves_old_counts() -> None:
    sk = FrequencySketch(16)
    for _ in range(8):
        sk.add("old")
    assert sk.estimate("old") == 8
    for i in range(sk.sample):
        sk.add(f"n{i}")
    assert sk.estimate("old") < 8


def test_admission_after_n_sightings() -> None:
    a = Admission()
    assert not a.admit("x", 2)
    assert a.admit("x", 1)  # 1: always
    a.seen(["x"])
    assert not a.admit("x", 2)
    a.seen(["x", "y"])
    assert a.admit("x", 2)
    assert not a.admit("x", 3)
    assert a.count("y") == 1
    with pytest.raises(ValueError, match="admit_after"):
        a.admit("x", 0)


@pytest.mark.parametrize("n", [10, 1000, 50000])
def test_hyperloglog_within_error(n: int) -> None:
    h = HyperLogLog(12)
    for i in range(n):
        h.add(f"chunk-{i}")
        h.add(f"chunk-{i}")  # repeats do not count
    assert abs(h.count() - n) <= max(1, 0.05 * n)


def test_ceiling_tracks_reuse() -> None:
    c = HitRateCeiling()
    assert c.ceiling() == 0.0
    for _ in range(4):
        c.observe([f"k{i}" for i in range(2000)])
    assert c.lookups == 8000
    assert abs(c.ceiling() - 0.75) < 0.02
    one_off = HitRateCeiling()
    one_off.observe([f"u{i}" for i in range(5000)])
    assert one_off.ceiling() < 0.03


def test_sampled_ceiling_keeps_the_ratio() -> None:
    c = HitRateCeiling(sample_bits=3)
    keys = [f"k{i}" for i in range(20000)]
    for _ in range(4):
        c.observe(keys)
    assert 0.08 * 80000 < c.lookups < 0.17 * 80000  # about one key in 8
    assert abs(c.ceiling() - 0.75) < 0.03


def test_quotas() -> None:
    q = TenantQuotas({"a": 100}, default=0)
    assert q.enabled
    q.add("a", 60)
    assert not q.over("a", 40)
    assert q.over("a", 41)
    assert not q.over("b", 10**9)  # unlimited
    q.add("a", -60)
    assert q.held == {}
    with pytest.raises(ValueError, match="'a'"):
        TenantQuotas({"a": -1})
    assert not TenantQuotas().enabled


def test_labels_are_bounded() -> None:
    labels = TenantLabels(2)
    assert [labels.label(t) for t in ["x", "", "y", "x", OTHER]] == ["x", "default", OTHER, "x", OTHER]
