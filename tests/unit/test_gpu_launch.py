"""Driver launches of bound kernels (``tiercache.gpu.launch``): a kernel is launched through the native
extension only when the driver's parameter list is exactly Triton's non-constexpr arguments plus its scratch
pointers; without a driver nothing is bound natively (Triton's launcher runs)."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiercache.gpu import launch
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
