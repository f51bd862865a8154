"""L2 adapters: the Adapter ABC and the built-in backends (imported lazily through the registry)."""

from __future__ import annotations

from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_keys, check_lengths
from tiercache.adapters.options import (
    MAX_SIZE,
    Range,
    Size,
    check_options,
    merge_options,
    option_parsers,
    option_ranges,
    parse_bool,
    parse_float,
    parse_int,
    parse_options,
    parse_size,
    parse_str,
)

__all__ = [
    "MAX_SIZE",
    "Adapter",
    "Buffer",
    "Capabilities",
    "Range",
    "Size",
    "check_key",
    "check_keys",
    "check_lengths",
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
