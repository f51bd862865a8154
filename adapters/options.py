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
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import parse_qsl

from tiercache.errors import ConfigError

__all__ = [
    "Size",
    "merge_options",
    "option_parsers",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_options",
    "parse_size",
    "parse_str",
]

T = TypeVar("T")

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


def parse_options(cls: type[T], adapter: str, query: str, options: Mapping[str, object]) -> T:
    """``query`` plus ``options`` (which win) parsed into the options dataclass ``cls``; fields not given
    keep their defaults. Unknown or bad options: ``ConfigError`` naming ``adapter`` and the option."""
    parsed = merge_options(adapter, query, options, option_parsers(cls))
    return cls(**parsed)
