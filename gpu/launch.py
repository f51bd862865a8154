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

A bound launch (``bind_launch``) goes one step further where it can: a small C extension (``gpu/_launch.c``,
built by ``setup.py`` as an optional extension) calls the CUDA driver's ``cuLaunchKernel`` with the kernel
parameters packed once, skipping Triton's Python launcher and its per-call parsing of every argument. It does
so only when the compiled kernel's parameters, read back from the driver (``cuFuncGetParamInfo``), are
exactly the non-constexpr arguments of Triton's signature (pointers and integers) followed by Triton's
scratch pointers, and the kernel needs no scratch memory, cluster, cooperative or PDL launch; otherwise, or
without the extension, or with ``TIERCACHE_DIRECT_LAUNCH=0`` (read at import), it calls Triton's launcher.
A launch the driver refuses (no CUDA context current on a new thread) is made again through Triton's launcher,
which sets the context up.
"""

from __future__ import annotations

import importlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _load_native() -> Any:
    """The launch extension (``gpu/_launch.c``), or None when it was not built."""
    try:
        return importlib.import_module("tiercache.gpu._launch")
    except ImportError:  # pragma: no cover - built without a C compiler
        return None


_native: Any = _load_native()
# the extension's identity check of a container's items (``same_items``: True, False, or None for a kind it
# does not know), or None without the extension
SAME_ITEMS: Callable[[Any, tuple[Any, ...]], bool | None] | None = getattr(_native, "same_items", None)

__all__ = [
    "SAME_ITEMS",
    "Ptr",
    "bind_launch",
    "current_stream",
    "launch",
    "native_copies",
    "param_plan",
    "prebound_enabled",
    "sync_stream",
]


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
DIRECT = os.environ.get("TIERCACHE_DIRECT_LAUNCH", "1") != "0"  # driver launches of bound kernels
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
        return (compiled.run, compiled.function, compiled.packed_metadata, compiled)
    except AttributeError:  # pragma: no cover - depends on the Triton version
        return None


def _bound(
    kernel: Any, grid: tuple[int, int, int], args: Sequence[Any], meta: dict[str, Any], index: int
) -> Any:
    """(launcher, function, packed metadata, compiled kernel) of this specialization (compiled on first
    sight), or None."""
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
    run, function, packed, _ = bound
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
    kernel, grid and arguments on the current stream of ``device`` (one driver call where the parameters
    could be verified, else one call of Triton's launcher; its ``direct`` attribute says which). The tensors
    behind ``args`` must outlive it. Without pre-bound launches it calls ``launch`` each time."""
    index = device.index or 0
    bound = _bound(kernel, grid, args, meta, index) if prebound_enabled() else None
    if bound is None:
        return lambda: launch(kernel, grid, args, meta, device)
    run, function, packed, compiled = bound
    g0, g1, g2 = grid
    values = tuple(_values(kernel, args, meta))
    raw_stream = torch._C._cuda_getCurrentRawStream
    current = torch._C._cuda_getDevice

    def through_triton() -> None:
        run(g0, g1, g2, raw_stream(index), function, packed, None, None, None, *values)

    handle = _direct_handle(compiled, grid, values) if DIRECT else None
    if handle is None:
        fire = through_triton
    else:
        native_launch = _native.launch

        def fire() -> None:
            if native_launch(handle, raw_stream(index)):  # refused (no context on this thread): Triton
                through_triton()  # sets it up

    def go() -> None:
        if current() != index:
            with torch.cuda.device(index):
                fire()
            return
        fire()

    go.direct = handle is not None  # type: ignore[attr-defined]  # for tests and benchmarks
    return go


# ------------------------------------------------------------------------------ driver launches

_FORMATS = {"i32": "i", "i64": "q", "u32": "I", "u64": "Q"}  # struct formats of the integer parameters
_PTR = "Q"


def param_plan(signature: Sequence[str], scratch: int, param_size: Callable[[int], int | None]) -> str | None:
    """The ``struct`` format of each parameter (one character per parameter) of a compiled kernel whose
    Triton signature types are ``signature`` (one per argument, ``"constexpr"`` for those compiled in), or
    None when they cannot be passed directly. ``param_size(i)`` is the driver's size of parameter ``i``
    (None past the last): the kernel must take exactly the non-constexpr arguments, each of the size its
    type says, then ``scratch`` pointers (Triton's scratch buffers, passed as NULL), and nothing more."""
    plan = ""
    for ty in signature:
        if ty == "constexpr":
            continue
        fmt = _PTR if ty.startswith("*") else _FORMATS.get(ty)
        if fmt is None:
            return None
        plan += fmt
    plan += _PTR * scratch
    if any(param_size(i) != struct.calcsize(f) for i, f in enumerate(plan)):
        return None
    return plan if param_size(len(plan)) is None else None


def _scratch_params(metadata: Any) -> int:
    """How many scratch pointers this Triton appends to a kernel's parameters (3.5+: global and profile;
    3.3-3.4: global; older: none), told by the metadata fields that size them."""
    return int(hasattr(metadata, "global_scratch_size")) + int(hasattr(metadata, "profile_scratch_size"))


def _direct_handle(compiled: Any, grid: tuple[int, int, int], values: Sequence[Any]) -> Any:
    """The native launch of ``compiled`` on ``grid`` with ``values`` (every argument, constexprs included,
    in order), or None when there is no extension or driver, or this kernel's parameters cannot be verified
    or need what only Triton's launcher does (scratch memory, clusters, cooperative or PDL launches)."""
    md = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if _native is None or md is None or not isinstance(signature, dict) or len(signature) != len(values):
        return None
    if (
        getattr(md, "global_scratch_size", 0)
        or getattr(md, "profile_scratch_size", 0)
        or getattr(md, "launch_cooperative_grid", False)
        or getattr(md, "launch_pdl", False)
        or getattr(md, "num_ctas", 1) != 1
    ):
        return None
    function = int(compiled.function)
    types = [str(t) for t in signature.values()]
    try:
        plan = param_plan(types, _scratch_params(md), lambda i: _native.param_size(function, i))
        if plan is None:
            return None
        passed = [int(v) for v, t in zip(values, types, strict=True) if t != "constexpr"]
        passed += [0] * (len(plan) - len(passed))  # NULL scratch pointers
        offsets, at = [], 0
        for f in plan:  # each value at its natural alignment
            at = -(-at // struct.calcsize(f)) * struct.calcsize(f)
            offsets.append(at)
            at += struct.calcsize(f)
        packed = bytearray(max(at, 1))
        for f, off, v in zip(plan, offsets, passed, strict=True):
            struct.pack_into(f, packed, off, v)
        return _native.make(function, *grid, 32 * md.num_warps, md.shared, bytes(packed), offsets)
    except (OSError, struct.error, OverflowError):  # no driver, or a value its type cannot hold
        return None


def sync_stream(index: int) -> None:
    """Wait for the current stream of CUDA device ``index`` (one driver call through the extension; torch's
    wait, which raises a readable error, when it is missing or the driver's call fails)."""
    if _native is not None and DIRECT:
        try:
            if not _native.sync(torch._C._cuda_getCurrentRawStream(index)):
                return
        except OSError:  # a driver older than CUDA 12.4
            pass
    current_stream(index).synchronize()


def native_copies() -> Any:
    """The launch extension when it can also issue copies and events to the driver (``make_copy``, ``copy``,
    ``record``, ``wait_event``, ``context``, ``sync``; see ``gpu/_launch.c``), else None: not built, or
    ``TIERCACHE_DIRECT_LAUNCH=0``, or launches not pre-bound."""
    if _native is None or not DIRECT or not prebound_enabled() or not hasattr(_native, "make_copy"):
        return None
    return _native


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
