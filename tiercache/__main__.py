"""``python -m tiercache`` runs the CLI."""

from __future__ import annotations

import sys

from tiercache.cli import main

sys.exit(main())
