"""Regenerate docs/knobs.md from the knob table in src/hora/common/knobs.py: `python scripts/gen_knobs_doc.py`."""

from __future__ import annotations

import pathlib

from hora.common.knobs import horovod_only_markdown, knobs_markdown

HEADER = """# Tuning knobs

Every knob is an environment variable read once, by `hora/common/knobs.py` (through `hora/common/env.py`, the one
reader of the environment), when `hvd.init()` runs. `hora run` sets the matching ones from its flags (for example
`--stall-check-warning-time-seconds` sets `HORA_STALL_CHECK_TIME_SECONDS`). Horovod's variable names are accepted
as aliases. This file is generated from the table in `src/hora/common/knobs.py`; a test fails when it is out of
date.

"""

HOROVOD_ONLY_HEADER = """
## Horovod variables hora has no mechanism for

Horovod 0.28.1 reads these (`horovod/common/common.h` and its logging); hora accepts them and does nothing with
them, for the reason given. Rank 0 says so once, at `hvd.init()`, for each one that is set. The matching
`hora run` flags (`--hierarchical-allgather`, `--torus-allreduce`, `--num-nccl-streams`, ...) print the same kind
of note when given.

"""


def document() -> str:
    """The whole of docs/knobs.md."""
    return HEADER + knobs_markdown() + HOROVOD_ONLY_HEADER + horovod_only_markdown()

if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "knobs.md"
    out.write_text(document())
