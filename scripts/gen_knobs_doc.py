"""Regenerate docs/knobs.md from the knob table in src/hora/common/knobs.py: `python scripts/gen_knobs_doc.py`."""

from __future__ import annotations

import pathlib

from hora.common.knobs import knobs_markdown

HEADER = """# Tuning knobs

Every knob is an environment variable read once, by `hora/common/knobs.py` (through `hora/common/env.py`, the one
reader of the environment), when `hvd.init()` runs. `hora run` sets the matching ones from its flags (for example
`--stall-check-warning-time-seconds` sets `HORA_STALL_CHECK_TIME_SECONDS`). Horovod's variable names are accepted
as aliases. This file is generated from the table in `src/hora/common/knobs.py`; a test fails when it is out of
date.

"""

if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "knobs.md"
    out.write_text(HEADER + knobs_markdown())
