"""Every number a deployment sets is range-checked when it is read: adapter options (URL query or keywords)
and the config file's ``chunk_size``, ``[l1]``, ``[manager]``, ``[[tiers]]`` and ``[server]`` numbers. A value
out of range (negative, zero where that is invalid, NaN, infinity, ``1e400``, integers past 64 bits) is one
``ConfigError`` line naming the option, its range and the value: never an ``OverflowError``, and never a tier
kept as down and re-opened forever."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import io
import json
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.adapters.options import Range, option_ranges, parse_options
from tiercache.config import MANAGER_RANGES, ManagerConfig, config_from_dict, load_config
from tiercache.errors import ConfigError

# (module, options class, adapter name in messages); the module is imported where its client library is.
ADAPTERS = [
    ("tiercache.adapters.posix", "PosixOptions", "file"),
    ("tiercache.adapters.nvme_slab", "SlabOptions", "nvme+slab"),
    ("tiercache.adapters.s3", "S3Options", "s3"),
    ("tiercache.adapters.mooncake", "MooncakeOptions", "mooncake"),
    ("tiercache.adapters.memory", "MemoryOptions", "memory"),
    ("tiercache.adapters.redis", "RedisOptions", "redis"),
]

BAD_NUMBERS: list[object] = [
    -1,
    0,
    -0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e400,  # a float literal: infinity
    "1e400",
    "nan",
    "-inf",
    1e300,
    10**30,
    2**63,
    10**400,
    "9" * 400,
    "-5",
]


def _options_class(module: str, name: str) -> type[Any]:
    try:
        return typing.cast("type[Any]", getattr(importlib.import_module(module), name))
    except ImportError as exc:  # an adapter's client library that is not installed here
        pytest.skip(f"{module}: {exc}")


def _numeric_fields(cls: type[Any]) -> list[str]:
    return list(option_ranges(cls))


def _declared_range(annotation: object) -> Range | None:
    """The ``Range`` written in a field's type (not the type's default)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for member in typing.get_args(annotation):
            found = _declared_range(member)
            if found is not None:
                return found
        return None
    if typing.get_origin(annotation) is Annotated:
        return next((x for x in typing.get_args(annotation)[1:] if isinstance(x, Range)), None)
    return None


def _as_number(value: object) -> float | int | None:
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return float(value)
    return value if isinstance(value, int | float) else None


def _in(value: object, bounds: Range) -> bool:
    number = _as_number(value)
    if number is None or (isinstance(number, float) and not math.isfinite(number)):
        return False
    return bounds.low <= number <= bounds.high


def _assert_refused(exc: BaseException, option: str, bounds: Range) -> None:
    message = str(exc)
    assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {message}"
    assert "\n" not in message
    assert f"'{option}'" in message, message
    if "must be in" in message:
        assert f"{option!r} must be in [" in message


def _parse(cls: type[Any], adapter: str, query: str, options: dict[str, object]) -> BaseException | None:
    try:
        parse_options(cls, adapter, query, options)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize(("module", "name", "adapter"), ADAPTERS, ids=[a[2] for a in ADAPTERS])
def test_every_numeric_option_refuses_values_out_of_its_range(module: str, name: str, adapter: str) -> None:
    cls = _options_class(module, name)
    ranges = option_ranges(cls)
    assert ranges, f"{name} has no numeric options?"
    for option, bounds in ranges.items():
        for value in BAD_NUMBERS:
            if _in(value, bounds):
                continue  # e.g. 0 where 0 is valid
            as_keyword = _parse(cls, adapter, "", {option: value})
            assert as_keyword is not None, f"{option}={value!r} was accepted"
            _assert_refused(as_keyword, option, bounds)
            if isinstance(value, str | int) or math.isfinite(typing.cast("float", value)):
                in_query = _parse(cls, adapter, f"{option}={value}", {})
                assert in_query is not None, f"?{option}={value} was accepted"
                _assert_refused(in_query, option, bounds)


@pytest.mark.parametrize(("module", "name", "adapter"), ADAPTERS[:-1], ids=[a[2] for a in ADAPTERS[:-1]])
def test_every_numeric_option_declares_its_range(module: str, name: str, adapter: str) -> None:
    cls = _options_class(module, name)
    hints = typing.get_type_hints(cls, include_extras=True)
    undeclared = [f for f in _numeric_fields(cls) if _declared_range(hints[f]) is None]
    assert undeclared == []
    for field in dataclasses.fields(cls):  # the defaults lie inside
        default = getattr(cls(), field.name)
        bounds = option_ranges(cls).get(field.name)
        if bounds is not None and default is not None:
            assert bounds.low <= default <= bounds.high, field.name


def test_redis_options_declare_their_ranges() -> None:
    cls = _options_class("tiercache.adapters.redis", "RedisOptions")
    hints = typing.get_type_hints(cls, include_extras=True)
    assert [f for f in _numeric_fields(cls) if _declared_range(hints[f]) is None] == []


numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda n: n * 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers().map(str),
    st.sampled_from(["1e400", "-1e400", "nan", "inf", "1" * 500]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ADAPTERS), st.data(), numbers, st.booleans())
def test_any_number_is_a_value_in_range_or_a_config_error(
    adapter: tuple[str, str, str], data: st.DataObject, value: object, in_query: bool
) -> None:
    module, name, label = adapter
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError:
        return
    ranges = option_ranges(cls)
    option = data.draw(st.sampled_from(sorted(ranges)))
    query, options = (f"{option}={value}", {}) if in_query else ("", {option: value})
    try:
        parsed = parse_options(cls, label, query, options)
    except ConfigError as exc:
        _assert_refused(exc, option, ranges[option])
    else:
        got = getattr(parsed, option)
        assert ranges[option].low <= got <= ranges[option].high
        assert not isinstance(got, float) or math.isfinite(got)


# -- the config file ------------------------------------------------------------------------------------

SERVER_NUMBERS = [
    "slot_bytes",
    "region_bytes",
    "max_clients",
    "max_leases_per_client",
    "max_share_per_client",
    "orphan_grace_s",
    "metrics_port",
    "drain_s",
    "group",
    "admin_group",
    "server_uid",
]


def _config_numbers() -> list[tuple[str, dict[str, Any], str]]:
    """(name in messages, the document with the value's place as ``...``, the key to set)."""
    out: list[tuple[str, dict[str, Any], str]] = [
        ("chunk_size", {}, "chunk_size"),
        ("l1.capacity", {"l1": {}}, "capacity"),
        ("capacity", {"tiers": [{"name": "t", "url": "file:///tmp/tc-ranges"}]}, "capacity"),
    ]
    out += [(f"manager.{key}", {"manager": {}}, key) for key in MANAGER_RANGES]
    out += [(f"server.{key}", {"server": {}}, key) for key in SERVER_NUMBERS]
    return out


def _with(doc: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    if "tiers" in doc:
        doc["tiers"][0][key] = value
    elif doc:
        next(iter(doc.values()))[key] = value
    else:
        doc[key] = value
    return doc


def test_every_manager_number_has_a_range() -> None:
    assert set(MANAGER_RANGES) == {f.name for f in dataclasses.fields(ManagerConfig)}


@pytest.mark.parametrize(("name", "doc", "key"), _config_numbers(), ids=[c[0] for c in _config_numbers()])
def test_every_config_number_refuses_values_out_of_its_range(
    name: str, doc: dict[str, Any], key: str
) -> None:
    for value in [-1, -0.5, float("nan"), float("inf"), float("-inf"), 1e400, 1e300, 10**30, 2**63, 10**400]:
        try:
            config_from_dict(_with(doc, key, value), "cfg.toml")
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message
            assert name in message, message
            continue
        except Exception as exc:
            pytest.fail(f"{name} = {value!r}: {type(exc).__name__}: {exc}")
        pytest.fail(f"{name} = {value!r} was accepted")


@pytest.mark.parametrize("name", ["chunk_size", "manager.store_queue_size", "manager.l2_deadline_s"])
def test_zero_is_refused_where_it_is_invalid(name: str) -> None:
    section, _, key = name.rpartition(".")
    doc: dict[str, Any] = {section: {key: 0}} if section else {key: 0}
    with pytest.raises(ConfigError, match=rf"{name} must be in \[.*\], got 0$"):
        config_from_dict(doc, "cfg.toml")


@pytest.mark.parametrize(
    "text",
    ["chunk_size = " + "9" * 5000, "[manager]\nl2_deadline_s = 1e400", "[manager]\nstore_parallel = nan"],
)
def test_a_toml_file_with_an_impossible_number_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


# -- a tier with a bad option is refused, not kept down ---------------------------------------------------


def _tier_config(url: str, **options: object) -> dict[str, Any]:
    return {"l1": {"capacity": "8MiB"}, "tiers": [{"name": "bad", "url": url, "options": options}]}


BAD_TIERS = [
    ("redis://127.0.0.1:1/0", {"ttl": 1e400}, "ttl"),
    ("redis://127.0.0.1:1/0?ttl=1e400", {}, "ttl"),
    ("redis://127.0.0.1:1/0", {"socket_timeout": float("nan")}, "socket_timeout"),
    ("redis://127.0.0.1:1/0", {"pool_size": 10**400}, "pool_size"),
    ("file://{tmp}/posix", {"threads": 10**30}, "threads"),
    ("file://{tmp}/posix", {"temp_sweep_s": 1e400}, "temp_sweep_s"),
    ("nvme+slab://{tmp}/bad.slab", {"capacity": 10**400}, "capacity"),
    ("nvme+slab://{tmp}/bad.slab?capacity=1GiB", {"io_threads": 0}, "io_threads"),
    ("memory://bad", {"capacity": 2**64}, "capacity"),
]


@pytest.mark.parametrize(("url", "options", "option"), BAD_TIERS, ids=[f"{u}:{o}" for u, _, o in BAD_TIERS])
def test_the_manager_refuses_a_tier_with_a_bad_number(
    tmp_path: Path, url: str, options: dict[str, object], option: str
) -> None:
    from tiercache.store.manager import StorageManager

    config = config_from_dict(_tier_config(url.format(tmp=tmp_path), **options), "cfg.toml")

    async def open_manager() -> None:
        manager = await StorageManager.open(config, 4096, reopen_delay_s=60)
        await manager.aclose()
        pytest.fail("the manager opened (the tier was kept as a down tier)")

    with pytest.raises(ConfigError, match=f"'{option}'"):
        asyncio.run(open_manager())
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


@pytest.mark.parametrize("as_json", [False, True])
def test_check_reports_the_option_not_an_overflow(tmp_path: Path, as_json: bool) -> None:
    from tiercache.cli.main import main

    path = tmp_path / "c.toml"
    path.write_text('[[tiers]]\nname = "r"\nurl = "redis://127.0.0.1:1/0?ttl=1e400"\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["check", str(path), *(["--json"] if as_json else [])])
    text = out.getvalue()
    assert code == 1, text
    assert "OverflowError" not in text
    error = json.loads(text)["tiers"][0]["error"] if as_json else text
    assert "ConfigError: redis: option 'ttl' must be in [" in error
    assert "got inf" in error
