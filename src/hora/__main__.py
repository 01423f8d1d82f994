"""``python -m hora`` is the ``hora`` command."""

from __future__ import annotations

import sys

from hora.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
