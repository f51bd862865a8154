"""L2 adapters: the Adapter ABC and the built-in backends (imported lazily through the registry)."""

from __future__ import annotations

from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_lengths
from tiercache.adapters.options import (
    Size,
    merge_options,
    option_parsers,
    parse_bool,
    parse_float,
    parse_int,
    parse_options,
    parse_size,
    parse_str,
)

__all__ = [
    "Adapter",
    "Buffer",
    "Capabilities",
    "Size",
    "check_key",
    "check_lengths",
    "merge_options",
    "option_parsers",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_options",
    "parse_size",
    "parse_str",
]
