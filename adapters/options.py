"""Adapter options: URL query strings and keyword options turned into one typed, frozen dataclass.

Public for third-party adapters. Declare the options once, as a dataclass whose field types say how each
is parsed, and call ``parse_options``::

    @dataclass(frozen=True)
    class MyOptions:
        capacity: Size | None = None        # bytes or "64MiB"
        pool_size: int = 8
        socket_timeout: float = 5.0
        tls: bool = False
        mode: Literal["direct", "rename"] = "direct"
        secret: str | None = field(default=None, metadata={"parse": my_parser})   # a parser of its own

    opts = parse_options(MyOptions, "my-scheme", urlsplit(url).query, options)

Unknown options, bad values and wrong types are ``ConfigError`` naming the adapter and the option.

Every number is range-checked: declare an option's inclusive bounds in its type,
``threads: Annotated[int, Range(1, 1024)]`` (also ``Annotated[Size, Range(0, 1 << 40)] | None``); a value
outside them is a ``ConfigError`` naming the adapter, the option, the range and the value. A number without
declared bounds still has its type's: ``int`` a signed 64-bit integer, ``Size`` 0 to ``MAX_SIZE``, ``float``
any finite number (NaN and the infinities, ``1e400`` in a query, never pass).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import parse_qsl

from tiercache.errors import ConfigError
from tiercache.sizes import MAX_SIZE, in_range, parse_size

__all__ = [
    "MAX_SIZE",
    "Range",
    "Size",
    "check_options",
    "merge_options",
    "option_parsers",
    "option_ranges",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_options",
    "parse_size",
    "parse_str",
]

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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
    """A number from a float, an int or a string like ``"2.5"`` (URL query values are strings).

    ``"nan"``, ``"inf"`` and ``"1e400"`` parse (to NaN and infinity): an option's range refuses them."""
    if isinstance(value, bool):
        raise ValueError(f"invalid number {value!r}")
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # an int beyond any float: as far out of every range as infinity
            return float("inf") if value > 0 else float("-inf")
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
    ranges: Mapping[str, Range] | None = None,
) -> dict[str, Any]:
    """``query`` plus ``options`` (which win), each parsed by ``parsers`` and checked against its entry in
    ``ranges``; unknown, bad or out-of-range ones: ConfigError."""
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
        bounds = (ranges or {}).get(name)
        if bounds is not None and out[name] is not None:
            in_range(out[name], bounds.low, bounds.high, f"{adapter}: option {name!r}")
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """Inclusive bounds of a numeric option, declared in its type: ``Annotated[int, Range(1, 1024)]``."""

    low: float
    high: float


class _SizeMarker:
    """Marks an ``int`` option given as bytes or a size string ("512MiB")."""


Size = Annotated[int, _SizeMarker]
"""An option in bytes that also accepts "512MiB", "8GiB" (``parse_size``)."""

_BY_TYPE: dict[object, Callable[[object], Any]] = {
    int: parse_int,
    float: parse_float,
    bool: parse_bool,
    str: parse_str,
}


_INT_RANGE = Range(-(1 << 63), (1 << 63) - 1)
_DEFAULT_RANGES: dict[object, Range] = {
    int: _INT_RANGE,
    float: Range(-sys.float_info.max, sys.float_info.max),
}


def _range_of(annotation: object) -> Range | None:
    """The declared ``Range`` of a field type, else its type's own (``Size``: 0..MAX_SIZE); None if it is
    not a number."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *extras = typing.get_args(annotation)
        for extra in extras:
            if isinstance(extra, Range):
                return extra
        if _SizeMarker in extras:
            return Range(0, MAX_SIZE)
        return _range_of(base)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _range_of(members[0]) if len(members) == 1 else None
    return _DEFAULT_RANGES.get(annotation)


def _parser_of(annotation: object, where: str) -> Callable[[object], Any]:
    """The parser for one field type: int, float, bool, str, ``Size``, ``Literal[...]``, ``X | None``."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *extras = typing.get_args(annotation)
        if _SizeMarker in extras:
            return parse_size
        return _parser_of(base, where)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _parser_of(members[0], where)
    if origin is Literal:
        choices = typing.get_args(annotation)

        def parse_choice(value: object) -> object:
            for choice in choices:
                if value == choice or (isinstance(value, str) and str(choice) == value.strip().lower()):
                    return choice
            raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {value!r}")

        return parse_choice
    parser = _BY_TYPE.get(annotation)
    if parser is None:
        raise TypeError(
            f"{where}: no parser for the option type {annotation!r}; give one in metadata['parse']"
        )
    return parser


def option_parsers(cls: type[Any]) -> dict[str, Callable[[object], Any]]:
    """Each field of the options dataclass ``cls`` and its parser (from the field's type, or the
    ``metadata["parse"]`` callable where one is given)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    out: dict[str, Callable[[object], Any]] = {}
    for f in dataclasses.fields(cls):
        custom = f.metadata.get("parse")
        out[f.name] = custom if custom is not None else _parser_of(hints[f.name], f"{cls.__name__}.{f.name}")
    return out


def option_ranges(cls: type[Any]) -> dict[str, Range]:
    """The bounds of each numeric field of the options dataclass ``cls``: its declared ``Range``, else its
    type's own (see the module docstring)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    out: dict[str, Range] = {}
    for f in dataclasses.fields(cls):
        bounds = _range_of(hints[f.name])
        if bounds is not None:
            out[f.name] = bounds
    return out


def check_options(opts: object, adapter: str) -> None:
    """ConfigError naming ``adapter``, the option, its range and the value unless every numeric field of the
    options dataclass instance ``opts`` is within its bounds (for options built in code, not parsed)."""
    for name, bounds in option_ranges(type(opts)).items():
        value = getattr(opts, name)
        if value is not None:
            in_range(value, bounds.low, bounds.high, f"{adapter}: option {name!r}")


def parse_options(cls: type[T], adapter: str, query: str, options: Mapping[str, object]) -> T:
    """``query`` plus ``options`` (which win) parsed into the options dataclass ``cls``; fields not given
    keep their defaults. Unknown, bad or out-of-range options: ``ConfigError`` naming ``adapter`` and the
    option (and, for a number, its range and the value)."""
    parsed = merge_options(adapter, query, options, option_parsers(cls), option_ranges(cls))
    return cls(**parsed)
