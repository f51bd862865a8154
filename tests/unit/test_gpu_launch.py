"""Driver launches of bound kernels (``tiercache.gpu.launch``): a kernel is launched through the native
extension only when the driver's parameter list is exactly Triton's non-constexpr arguments plus its scratch
pointers; without a driver nothing is bound natively (Triton's launcher runs)."""

from __future__ import annotations

import collections
import struct
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.gpu import launch
from tiercache.gpu import triton_kernels as tk
from tiercache.gpu.launch import param_plan

FORMATS = {"*bf16": "Q", "*i64": "Q", "i32": "i", "i64": "q", "u64": "Q"}
signatures = st.lists(st.sampled_from([*FORMATS, "constexpr"]), max_size=12)


def sizes_of(signature: list[str], scratch: int) -> list[int]:
    """What the driver reports for a kernel compiled from ``signature`` with ``scratch`` scratch pointers."""
    return [struct.calcsize(FORMATS[t]) for t in signature if t != "constexpr"] + [8] * scratch


def driver(sizes: list[int]) -> Any:
    return lambda i: sizes[i] if i < len(sizes) else None


@given(signatures, st.integers(0, 2))
def test_a_matching_kernel_gets_one_format_per_parameter(signature: list[str], scratch: int) -> None:
    plan = param_plan(signature, scratch, driver(sizes_of(signature, scratch)))
    assert plan == "".join(FORMATS[t] for t in signature if t != "constexpr") + "Q" * scratch


@given(signatures, st.integers(0, 2), st.data())
def test_any_mismatch_with_the_driver_means_no_direct_launch(
    signature: list[str], scratch: int, data: st.DataObject
) -> None:
    sizes = sizes_of(signature, scratch)
    how = data.draw(st.sampled_from(["resize", "extra_param", "drop_param", "other_scratch"]))
    if not sizes and how in ("resize", "drop_param"):
        how = "extra_param"
    if how == "resize":
        i = data.draw(st.integers(0, len(sizes) - 1))
        sizes[i] = data.draw(st.sampled_from([1, 2, 4, 8, 16]).filter(lambda n: n != sizes[i]))
    elif how == "extra_param":
        sizes.append(4)
    elif how == "drop_param":
        del sizes[data.draw(st.integers(0, len(sizes) - 1))]
    else:
        scratch = data.draw(st.integers(0, 2).filter(lambda n: n != scratch))
    assert param_plan(signature, scratch, driver(sizes)) is None


def test_types_only_tritons_launcher_can_pass_are_refused() -> None:
    for ty in ("fp32", "fp16", "i1", "nvTmaDesc", "tensordesc<bf16[64]>"):
        assert param_plan(["*bf16", ty], 0, driver([8, 4])) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA driver")
def test_without_a_driver_nothing_is_bound_natively() -> None:
    """The extension is built (setup.py), but with no libcuda ``make`` raises OSError and a bound launch
    keeps Triton's launcher (``_direct_handle`` is None) instead of failing."""
    native = pytest.importorskip("tiercache.gpu._launch")
    with pytest.raises(OSError, match="libcuda"):
        native.make(0, 1, 1, 1, 128, 0, b"\0" * 8, [0])
    compiled = SimpleNamespace(
        function=1,
        src=SimpleNamespace(signature={"p": "*bf16", "n": "i32", "B": "constexpr"}),
        metadata=SimpleNamespace(num_warps=4, shared=0, global_scratch_size=0, profile_scratch_size=0),
    )
    assert launch._direct_handle(compiled, (1, 1, 1), (0x1000, 7, 16)) is None


def test_a_copy_with_bad_geometry_is_refused_before_the_driver() -> None:
    """``make_copy`` refuses an empty copy or a pitch shorter than a row, driver or not."""
    native = pytest.importorskip("tiercache.gpu._launch")
    for args in (
        (0, True, 64, 0, False, 32, 64, 1),
        (0, True, 64, 0, False, 64, 0, 1),
        (0, True, 8, 0, 1, 8, 8, 0),
    ):
        with pytest.raises(ValueError, match="pitches >= width"):
            native.make_copy(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA driver")
def test_without_a_driver_no_copy_is_made() -> None:
    """With no libcuda a copy cannot be made: OSError, not a crash."""
    native = pytest.importorskip("tiercache.gpu._launch")
    with pytest.raises(OSError, match="libcuda"):
        native.make_copy(0, True, 64, 0, False, 64, 64, 2)


def test_driver_copies_follow_the_direct_launch_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer pieces issue their copies through the extension only while direct launches are on."""
    native = pytest.importorskip("tiercache.gpu._launch")
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "DIRECT", True)
    assert launch.native_copies() is native
    monkeypatch.setattr(launch, "DIRECT", False)
    assert launch.native_copies() is None
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch, "ENABLED", False)
    assert launch.native_copies() is None


@settings(max_examples=200)
@given(data=st.data(), n=st.integers(0, 40))
def test_same_items_is_identity_of_every_item_in_order(data: st.DataObject, n: int) -> None:
    """The extension's ``same_items`` answers as the Python identity check for lists, tuples and dicts (in
    order), whatever was changed (an item swapped for an equal object, two items exchanged, one added or
    removed), and declines (None) any other container."""
    native = pytest.importorskip("tiercache.gpu._launch")
    objs = [object() for _ in range(n)]
    ref = tuple(objs)
    items = list(objs)
    change = data.draw(st.sampled_from(["none", "swap_in", "exchange", "append", "drop"]))
    if change == "swap_in" and n:
        items[data.draw(st.integers(0, n - 1))] = object()
    elif change == "exchange" and n >= 2:
        i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        items[i], items[j] = items[j], items[i]
    elif change == "append":
        items.append(object())
    elif change == "drop" and n:
        items.pop(data.draw(st.integers(0, n - 1)))
    want = len(items) == len(ref) and all(a is b for a, b in zip(items, ref, strict=False))
    assert native.same_items(items, ref) is want
    assert native.same_items(tuple(items), ref) is want
    assert native.same_items({f"layer.{i}": x for i, x in enumerate(items)}, ref) is want
    assert native.same_items(collections.OrderedDict(enumerate(items)), ref) is None
    assert native.same_items(types.MappingProxyType(dict(enumerate(items))), ref) is None
    with pytest.raises(TypeError):
        native.same_items(items, list(ref))


def test_registered_kv_caches_are_rechecked_by_identity() -> None:
    """A registration notices a layer tensor swapped for another (also an equal one), in a list or a dict,
    through the extension and without it."""
    layers = [torch.zeros(4) for _ in range(3)]
    reg = tk._Registered(layers, tuple(layers), layers[0].data_ptr(), ())
    named = {f"l{i}": t for i, t in enumerate(layers)}
    for check in (tk._SAME_ITEMS, None):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tk, "_SAME_ITEMS", check)
            assert tk._same_layers(reg, layers)
            assert tk._same_layers(reg, named)
            assert not tk._same_layers(reg, [*layers[:2], torch.zeros(4)])
            assert not tk._same_layers(reg, {**named, "l2": torch.zeros(4)})
            assert not tk._same_layers(reg, layers[:2])
