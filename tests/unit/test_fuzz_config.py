"""Fuzzing the config loader (short run; the long run is ``make fuzz``): any document is a Config or a
ConfigError, any text a TOML error or one of those, never another exception."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.testing.harness import fuzz

CONFIG = fuzz.ConfigFuzz()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
schema_keys = st.sampled_from(["chunk_size", "save_unfull_chunk", "cache_salt_env", "l1", "manager", "tiers"])
tier_keys = st.sampled_from(["name", "url", "capacity", "codecs", "options", "adapter"])
tiers = st.lists(st.dictionaries(tier_keys, json_values, max_size=6), max_size=3)


@SETTINGS
@given(st.dictionaries(schema_keys | st.text(max_size=6), json_values, max_size=6), tiers)
def test_any_document_is_a_config_or_config_error(doc: dict[str, Any], tier_list: list[Any]) -> None:
    doc.setdefault("tiers", tier_list)
    assert CONFIG.check_doc(doc) in ("accepted", "rejected")


@SETTINGS
@given(st.randoms(use_true_random=False))
def test_schema_shaped_documents(rng: random.Random) -> None:
    assert CONFIG.check_doc(CONFIG.random_doc(rng)) in ("accepted", "rejected")


@SETTINGS
@given(st.binary(max_size=300))
def test_any_text_is_a_toml_error_config_or_config_error(text: bytes) -> None:
    assert CONFIG.check_text(text) in ("toml_error", "accepted", "rejected")


def test_the_valid_document_is_accepted() -> None:
    assert CONFIG.check_text(fuzz._VALID_TOML.encode()) == "accepted"


def test_short_fuzz_loop_has_no_findings() -> None:
    result = fuzz.run_target("config", 3000, seed=1)
    assert result["findings"] == []
    assert "finding" not in result["outcomes"]
