"""The connector's logging: each connector module logs under tiercache's one ``tiercache`` hierarchy
(``logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))``), and inside vLLM the
``tiercache`` logger writes through vLLM's own handlers, so every tiercache line (connector, store, adapters)
carries vLLM's time, level and process like vLLM's own."""

from __future__ import annotations

import logging

__all__ = ["ROOT", "use_vllm_handlers"]

ROOT = "tiercache"
"""The logger every tiercache module logs under."""


def use_vllm_handlers() -> bool:
    """Give the ``tiercache`` logger vLLM's handlers (and vLLM's level, unless one is set) when it has no
    handler of its own. Returns whether it did: an application that configured ``tiercache`` logging
    itself, or a vLLM that configured none (``VLLM_CONFIGURE_LOGGING=0``), is left alone. Records still
    propagate to the root logger (vLLM leaves it without handlers; one configured by the application also
    gets them)."""
    ours = logging.getLogger(ROOT)
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    return True
