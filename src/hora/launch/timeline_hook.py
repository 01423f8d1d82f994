"""After a job: merge the ranks' timeline files (``--timeline-filename``) into the one file the user named."""

from __future__ import annotations

import logging
import os

from hora.diagnostics.merge import finish_job_timeline
from hora.launch import output

log = logging.getLogger(__name__)


def merge(filename: str | None, size: int) -> None:
    """Merge the rank files of ``filename`` into it; a failed merge is one note, never the job's status."""
    if not filename:
        return
    try:
        finish_job_timeline(filename, size)
    except Exception as exc:  # noqa: BLE001 - a broken merge must not change the job's exit status
        output.note(f"could not merge the timeline files into {filename}: {exc}")
        return
    if os.path.exists(filename):
        output.note(f"timeline written to {os.path.abspath(filename)} (open it in https://ui.perfetto.dev "
                    "or chrome://tracing)")
