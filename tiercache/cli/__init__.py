"""``tiercache.cli``: the command line (``main``), the demo (``tiercache.cli.demo``) and ``tiercache bench``.

The top of the stack: it imports the store and the contracts, nothing imports it. ``import tiercache.cli``
stays light (no torch); each subcommand loads what it needs when it runs.
"""

from __future__ import annotations

from tiercache.cli.main import main

__all__ = ["main"]
