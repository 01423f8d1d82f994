"""After a job: merge the ranks' timeline files (``--timeline-filename``) into the one file the user named."""

from __future__ import annotations

import logging
import os

from hora.diagnostics.merge import finish_job_timeline, rank_parts
from hora.launcher import output

log = logging.getLogger(__name__)


def merge(filename: str | None, size: int, job: str) -> None:
    """Merge job ``job``'s rank files of ``filename`` into it; a failed merge is one note, never the job's status.
    A merge that found no events leaves an existing ``filename`` as it was (another job's timeline)."""
    if not filename:
        return
    path = os.path.abspath(filename)
    if not rank_parts(filename, job):  # each rank said why (a full disk, no init()): one line here, no merge
        left = "left as it was" if os.path.exists(filename) else "not written"
        output.note(f"no rank wrote a timeline file (did the ranks call hvd.init()? a rank that could not write "
                    f"its file said why): {path} {left}")
        return
    try:
        merged = finish_job_timeline(filename, size, job=job, remove_parts=True)
    except Exception as exc:  # noqa: BLE001 - a broken merge must not change the job's exit status
        output.note(f"could not merge the timeline files into {path}: {exc}; the ranks' files are kept: merge them "
                    f"later with python -m hora.diagnostics merge-timeline {filename} --job {job}")
        return
    if not merged:
        left = "left as it was" if os.path.exists(filename) else "not written"
        output.note(f"no rank wrote timeline events (did the ranks call hvd.init()?): {path} {left}")
        return
    output.note(f"timeline written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
