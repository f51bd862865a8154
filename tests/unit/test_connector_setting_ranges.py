"""The vLLM connector's numeric settings are range-checked when read: an absurd timeout or token count is
refused with one line naming the key and its range; a sane one is kept exactly."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiercache_vllm._common import _EXTRA_KEYS, _RANGES, ConnectorSettings

from tiercache.errors import ConfigError

NUMERIC = sorted(key for key, kinds in _EXTRA_KEYS.items() if int in kinds and bool not in kinds)
SECONDS = [key for key in NUMERIC if float in _EXTRA_KEYS[key]]


def test_every_numeric_setting_has_a_range() -> None:
    assert NUMERIC
    assert set(_RANGES) == set(NUMERIC)
    assert {"lookup_timeout_s", "load_timeout_s", "save_timeout_s", "open_timeout_s"} <= set(SECONDS)


def _outside(key: str) -> st.SearchStrategy[float]:
    """Numbers a setting must refuse: below or above its bounds, NaN and the infinities (floats only)."""
    low, high = _RANGES[key]
    ints = st.integers(max_value=math.ceil(low) - 1) | st.integers(min_value=math.floor(high) + 1)
    if key not in SECONDS:
        return ints
    floats = (
        st.floats(max_value=low, exclude_max=True)
        | st.floats(min_value=high, exclude_min=True)
        | st.sampled_from([2.0**53, 1e400, -1e400, math.nan, -0.0])
    )
    return ints | floats


@settings(max_examples=300, deadline=None)
@given(data=st.data(), key=st.sampled_from(NUMERIC))
def test_absurd_values_are_refused_naming_the_key(data: st.DataObject, key: str) -> None:
    value = data.draw(_outside(key), label="value")
    with pytest.raises(ConfigError) as refused:
        ConnectorSettings.from_extra({key: value})
    message = str(refused.value)
    assert "\n" not in message
    assert f"kv_connector_extra_config[{key!r}] must be in [" in message


def _inside(key: str) -> st.SearchStrategy[float]:
    low, high = _RANGES[key]
    ints = st.integers(math.ceil(low), math.floor(high))
    if key not in SECONDS:
        return ints
    return ints | st.floats(low, high, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), key=st.sampled_from(NUMERIC))
def test_sane_values_are_kept(data: st.DataObject, key: str) -> None:
    value = data.draw(_inside(key), label="value")
    got = getattr(ConnectorSettings.from_extra({key: value}), key)
    assert got == value
    assert type(got) is (float if key in SECONDS else int)


def test_the_found_timeout_is_refused() -> None:
    """A timeout of 2**53 seconds (found by fuzzing) no longer starts a connector."""
    with pytest.raises(ConfigError, match=r"'lookup_timeout_s'\] must be in \[0.001, 3600\], got"):
        ConnectorSettings.from_extra({"lookup_timeout_s": 2.0**53})
