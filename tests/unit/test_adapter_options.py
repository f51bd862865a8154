"""``tiercache.adapters.options``: one typed dataclass per adapter, parsed from its field types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercache.adapters import Size, option_parsers, parse_options, parse_size
from tiercache.errors import ConfigError


def _upper(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value.upper()


@dataclass(frozen=True)
class Opts:
    capacity: Size | None = None
    pool_size: int = 8
    timeout: float = 5.0
    tls: bool = False
    mode: Literal["direct", "rename"] = "direct"
    name: str = "x"
    shout: str | None = field(default=None, metadata={"parse": _upper})


def test_defaults_when_nothing_is_given() -> None:
    assert parse_options(Opts, "t", "", {}) == Opts()


def test_each_type_parses_from_the_query_string() -> None:
    got = parse_options(
        Opts, "t", "capacity=64MiB&pool_size=3&timeout=0.5&tls=yes&mode=rename&name=n&shout=hey", {}
    )
    assert got == Opts(
        capacity=64 << 20, pool_size=3, timeout=0.5, tls=True, mode="rename", name="n", shout="HEY"
    )


def test_keywords_win_over_the_query_and_keep_their_types() -> None:
    got = parse_options(Opts, "t", "pool_size=3&tls=0", {"pool_size": 9, "tls": True, "capacity": 1000})
    assert (got.pool_size, got.tls, got.capacity) == (9, True, 1000)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (
            "nope=1",
            r"t: unknown option\(s\) 'nope'; known: capacity, mode, name, pool_size, shout, timeout, tls",
        ),
        ("pool_size=many", r"t: option 'pool_size'"),
        ("mode=sideways", r"t: option 'mode': expected one of direct, rename"),
        ("tls=maybe", r"t: option 'tls'"),
        ("capacity=12 parsecs", r"t: option 'capacity'"),
    ],
)
def test_bad_options_are_config_errors_naming_adapter_and_option(query: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_options(Opts, "t", query, {})


def test_a_type_without_a_parser_is_refused_when_declared() -> None:
    @dataclass(frozen=True)
    class Bad:
        items: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match=r"Bad.items: no parser"):
        option_parsers(Bad)


@given(st.integers(min_value=0, max_value=1 << 50))
def test_size_fields_accept_bytes_and_size_strings(n: int) -> None:
    assert parse_options(Opts, "t", f"capacity={n}", {}).capacity == n == parse_size(n)
    assert parse_options(Opts, "t", "", {"capacity": f"{n}B"}).capacity == n
