"""Fuzzing the vLLM connector's settings decoding and slot mapping (short run; the long run is
``make fuzz``): a ValueError naming the key, or settings holding exactly the given values."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.testing.harness import fuzz

CONNECTOR = fuzz.ConnectorFuzz()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

values = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.lists(st.integers())
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(CONNECTOR.keys) | st.text(max_size=8), values, max_size=6))
def test_extra_config_is_settings_or_value_error(extra: dict[str, Any]) -> None:
    assert CONNECTOR.check_extra(extra) in ("accepted", "rejected")


def test_a_valid_extra_config_is_kept_exactly() -> None:
    extra = {"load_timeout_s": 3, "layerwise": True, "config": "/x.toml"}
    assert CONNECTOR.check_extra(extra) == "accepted"
    assert math.isclose(CONNECTOR.settings.from_extra(extra).load_timeout_s, 3.0)


@SETTINGS
@given(st.lists(st.integers(0, 1 << 24), max_size=10), st.integers(0, 200), st.sampled_from([1, 16, 32]))
def test_slot_mapping_matches_the_formula(blocks: list[int], tokens: int, block_size: int) -> None:
    assert CONNECTOR.check_slots(blocks, tokens, block_size) == "slots"


def test_short_fuzz_loop_has_no_findings() -> None:
    result = fuzz.run_target("connector", 3000, seed=1)
    assert result["findings"] == []
