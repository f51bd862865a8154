# mypy: disable-error-code="import-untyped"
"""Pre-bound Triton launches: compile through Triton once per specialization, then call the compiled
kernel's own launcher with the arguments in order (pointers as plain ints).

Triton's Python ``JITFunction.run`` binds the arguments, hashes a specialization key and checks each pointer
on every call (30-80 µs of host time); ``launch`` computes the same specialization itself (per int: equal to
1, divisible by 16, fits in 32 bits; per pointer: dtype and 16-byte alignment; every constexpr) and keeps the
compiled kernel under it, so a repeated launch costs a dict lookup and one C call. A specialization is
compiled without a launch (``warmup``: a pointer only lends its dtype and alignment, so a ``Ptr`` to pinned
host memory compiles through a device stand-in). The interpreter (``TRITON_INTERPRET=1``) and
``TIERCACHE_PREBOUND=0`` (both read at import) go through Triton's own ``kernel[grid](...)``; so does, for
good, a Triton whose compiled kernels lack the launcher attributes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Ptr", "bind_launch", "current_stream", "launch", "prebound_enabled"]


class Ptr:
    """A pointer argument given as an address and a dtype; ``make`` builds the typed tensor Triton's own
    ``run`` needs (only on a specialization's first launch, or when launches are not pre-bound)."""

    __slots__ = ("addr", "dtype", "make")

    def __init__(self, addr: int, dtype: torch.dtype, make: Callable[[], torch.Tensor]) -> None:
        self.addr = addr
        self.dtype = dtype
        self.make = make


_BOUND: dict[tuple[Any, ...], Any] = {}
_UNSEEN = object()
_ARG_NAMES: dict[int, tuple[str, ...]] = {}
_INT32 = (-(2**31), 2**31)


ENABLED = os.environ.get("TIERCACHE_PREBOUND", "1") != "0"  # read once; benchmarks flip it for an A/B
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prebound_enabled() -> bool:
    """False under the Triton interpreter or with ``TIERCACHE_PREBOUND=0`` at import (every launch goes
    through Triton's ``run``)."""
    return ENABLED and not _INTERPRETED


def _spec(v: Any) -> Any:
    """What Triton specializes one runtime argument on (ints: 1, multiple of 16, width; pointers: dtype and
    16-byte alignment)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return (v == 1, v % 16 == 0, _INT32[0] <= v < _INT32[1])
    if isinstance(v, Ptr):
        return (v.dtype, v.addr % 16 == 0)
    return (v.dtype, v.data_ptr() % 16 == 0)


def _typed(args: Sequence[Any]) -> list[Any]:
    return [a.make() if isinstance(a, Ptr) else a for a in args]


def _compile(kernel: Any, grid: tuple[int, int, int], args: Sequence[Any], meta: dict[str, Any]) -> Any:
    """Compile (no launch) for this specialization; (launcher, function, packed metadata), or None when this
    Triton's compiled kernels do not expose them."""
    names = _ARG_NAMES.get(id(kernel))
    if names is None:
        names = _ARG_NAMES[id(kernel)] = tuple(kernel.arg_names)
    compiled = kernel.warmup(*_typed(args), grid=grid, **meta)
    try:
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        return (compiled.run, compiled.function, compiled.packed_metadata)
    except AttributeError:  # pragma: no cover - depends on the Triton version
        return None


def _bound(
    kernel: Any, grid: tuple[int, int, int], args: Sequence[Any], meta: dict[str, Any], index: int
) -> Any:
    """(launcher, function, packed metadata) of this specialization (compiled on first sight), or None."""
    key = (id(kernel), index, *(_spec(a) for a in args), *meta.items())
    bound = _BOUND.get(key, _UNSEEN)
    if bound is _UNSEEN:
        bound = _compile(kernel, grid, args, meta)
        if len(_BOUND) > 1024:
            _BOUND.clear()
        _BOUND[key] = bound
    return bound


def _values(kernel: Any, args: Sequence[Any], meta: dict[str, Any]) -> list[Any]:
    """The launcher's argument values: pointers as ints, then the constexprs in the kernel's order."""
    names = _ARG_NAMES[id(kernel)]
    values = [a if isinstance(a, int) else (a.addr if isinstance(a, Ptr) else a.data_ptr()) for a in args]
    values.extend(meta[name] for name in names[len(args) :])
    return values


def launch(
    kernel: Any,
    grid: tuple[int, int, int],
    args: Sequence[Any],
    meta: dict[str, Any],
    device: torch.device,
) -> None:
    """Launch ``kernel[grid](*args, **meta)`` on the current stream of ``device`` (the current CUDA device),
    pre-bound when possible. ``args`` are the kernel's runtime parameters in order (tensors or ints);
    ``meta`` its constexprs by name plus launch options (``num_warps``)."""
    if not prebound_enabled():
        kernel[grid](*_typed(args), **meta)
        return
    index = device.index or 0  # KV tensors on CUDA name their device
    bound = _bound(kernel, grid, args, meta, index)
    if bound is None:  # pragma: no cover - a Triton without the launcher attributes
        kernel[grid](*_typed(args), **meta)
        return
    run, function, packed = bound
    stream = torch._C._cuda_getCurrentRawStream(index)
    run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *_values(kernel, args, meta))


def bind_launch(
    kernel: Any,
    grid: tuple[int, int, int],
    args: Sequence[Any],
    meta: dict[str, Any],
    device: torch.device,
) -> Callable[[], None]:
    """``launch`` with everything but the stream computed now: the returned function launches the same
    kernel, grid and arguments on the current stream of ``device`` (one C call). The tensors behind
    ``args`` must outlive it. Without pre-bound launches it calls ``launch`` each time."""
    index = device.index or 0
    bound = _bound(kernel, grid, args, meta, index) if prebound_enabled() else None
    if bound is None:
        return lambda: launch(kernel, grid, args, meta, device)
    run, function, packed = bound
    g0, g1, g2 = grid
    values = tuple(_values(kernel, args, meta))
    raw_stream = torch._C._cuda_getCurrentRawStream
    current = torch._C._cuda_getDevice

    def go() -> None:
        if current() != index:
            with torch.cuda.device(index):
                run(g0, g1, g2, raw_stream(index), function, packed, None, None, None, *values)
            return
        run(g0, g1, g2, raw_stream(index), function, packed, None, None, None, *values)

    return go


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)``, the Stream object cached by its raw handle (the torch call
    builds a new object through several Python layers each time)."""
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    s = _STREAMS.get(key)
    if s is None:
        s = torch.cuda.current_stream(index)
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        _STREAMS[key] = s
    return s
