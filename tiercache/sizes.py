"""Sizes and bounds shared by config files and adapter options: ``parse_size`` (``"8GiB"`` -> bytes),
``MAX_SIZE`` and ``in_range``, the one range rule (a ``ConfigError`` naming the value and its bounds)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from tiercache.errors import ConfigError

__all__ = ["MAX_SIZE", "in_range", "parse_size", "shown"]

MAX_SIZE = (1 << 63) - 1
"""The most bytes any size may name (the largest file offset; more would overflow C calls)."""

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
    if "." in number:  # exact: a float would overflow on a long number ("1" * 400 + ".5")
        return int(Fraction(number) * _UNITS[unit])
    return int(number) * _UNITS[unit]


def shown(number: float, exact: bool = True) -> str:
    """``number`` for a one-line message: ints in full up to 64 bits, floats as ``repr`` (when not ``exact``:
    whole ones as ints, others ``:g``)."""
    if isinstance(number, int) and not isinstance(number, bool):
        return str(number) if number.bit_length() <= 64 else f"a {number.bit_length()}-bit integer"
    if isinstance(number, float):
        if exact:
            return repr(number)
        return str(int(number)) if number.is_integer() and abs(number) < 2**53 else f"{number:g}"
    return repr(number)


def in_range(value: int | float, low: float, high: float, name: str) -> None:
    """ConfigError naming ``name``, the range and the value unless ``low <= value <= high`` (NaN and the
    infinities never are). The one range rule: config tables and adapter options alike."""
    if not low <= value <= high or (isinstance(value, float) and not math.isfinite(value)):
        bounds = f"[{shown(low, exact=False)}, {shown(high, exact=False)}]"
        raise ConfigError(f"{name} must be in {bounds}, got {shown(value)}")
