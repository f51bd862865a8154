"""Turn URL query strings and keyword options into typed adapter settings (sizes, booleans, integers)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

from tiercache.errors import ConfigError

__all__ = ["merge_options", "parse_bool", "parse_float", "parse_int", "parse_size", "parse_str"]

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(value: object) -> int:
    """Bytes from an int or a string: ``"123"``, ``"1.5GiB"``, ``"10GB"`` (KiB..TiB: 2**10; KB..TB: 10**3)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected bytes as an int or a string like '512MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"invalid size {value!r}: expected bytes as an int or a string like '512MiB'")
    m = _SIZE_RE.match(value)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {value!r}: use bytes or a number with a unit "
            "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '512MiB'"
        )
    number = m.group(1)
    if "." in number:
        return int(float(number) * _UNITS[unit])
    return int(number) * _UNITS[unit]


def parse_bool(value: object) -> bool:
    """A bool from a bool, 0/1, or a string (true/false, yes/no, on/off, 1/0)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    raise ValueError(f"invalid boolean {value!r}: use true/false, yes/no, on/off or 1/0")


def parse_int(value: object) -> int:
    """An int from an int or a decimal string (bools are rejected)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid integer {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"invalid integer {value!r}")


def parse_float(value: object) -> float:
    """A number from a float, an int or a string like ``"2.5"`` (URL query values are strings)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid number {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ValueError(f"invalid number {value!r}")


def parse_str(value: object) -> str:
    """``value`` if it is a string, else ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def merge_options(
    adapter: str,
    query: str,
    options: Mapping[str, object],
    parsers: Mapping[str, Callable[[object], Any]],
) -> dict[str, Any]:
    """``query`` plus ``options`` (which win), each parsed by ``parsers``; unknown/bad ones: ConfigError."""
    raw: dict[str, object] = dict(parse_qsl(query, keep_blank_values=True))
    raw.update(options)
    unknown = sorted(set(raw) - set(parsers))
    if unknown:
        raise ConfigError(
            f"{adapter}: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(parsers)) or 'none'}"
        )
    out: dict[str, Any] = {}
    for name, value in raw.items():
        try:
            out[name] = parsers[name](value)
        except ValueError as exc:
            raise ConfigError(f"{adapter}: option {name!r}: {exc}") from exc
    return out
