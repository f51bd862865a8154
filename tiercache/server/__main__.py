"""``python -m tiercache.server``: see :mod:`tiercache.server.main`."""

import sys

from tiercache.server.main import main

sys.exit(main())
