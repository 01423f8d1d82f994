"""``python -m hora.diagnostics merge-timeline t.json`` | ``python -m hora.diagnostics check [...]``."""

from __future__ import annotations

import sys

COMMANDS = {"merge-timeline": "hora.diagnostics.merge", "check": "hora.launcher.check"}


def _main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(f"usage: python -m hora.diagnostics {{{','.join(COMMANDS)}}} ...\n")
        return 2
    import importlib

    return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]))


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
