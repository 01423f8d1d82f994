"""After a job: merge the ranks' timeline files, if the diagnostics package provides the merger."""

from __future__ import annotations

import importlib
import logging

from hora.launch import output

log = logging.getLogger(__name__)


def merge(filename: str | None, size: int) -> None:
    """Call ``hora.diagnostics.timeline.merge_timelines`` for ``filename`` when both exist."""
    if not filename:
        return
    try:
        timeline = importlib.import_module("hora.diagnostics.timeline")
    except ImportError:
        log.info("hora.diagnostics.timeline not available: rank timelines left unmerged")
        return
    merger = getattr(timeline, "merge_timelines", None)
    if merger is None:
        return
    try:
        merger(filename, size)
    except Exception as exc:  # a broken merge must not change the job's exit status
        output.note(f"could not merge the timeline files into {filename}: {exc}")
