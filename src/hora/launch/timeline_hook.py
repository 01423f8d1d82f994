"""After a job: merge the ranks' timeline files with the diagnostics package's merger, when it exists."""

from __future__ import annotations

import importlib
import logging
import os

from hora.launch import output

log = logging.getLogger(__name__)


def merge(filename: str | None, size: int) -> None:
    """Call ``hora.diagnostics.timeline.finish_job_timeline`` (rank files -> ``filename``) if it exists."""
    if not filename:
        return
    try:
        timeline = importlib.import_module("hora.diagnostics.timeline")
    except ImportError:
        log.info("hora.diagnostics.timeline not available: rank timelines left unmerged")
        return
    merger = getattr(timeline, "finish_job_timeline", None)
    if merger is None:
        return
    try:
        merger(filename, size)
    except Exception as exc:  # noqa: BLE001 - a broken merge must not change the job's exit status
        output.note(f"could not merge the timeline files into {filename}: {exc}")
        return
    if os.path.exists(filename):
        output.note(f"timeline written to {os.path.abspath(filename)} (open it in https://ui.perfetto.dev "
                    "or chrome://tracing)")
