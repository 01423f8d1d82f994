"""Diagnostics: the stall inspector's parts, the timeline, ``hora check``.

* :mod:`hora.diagnostics.where`: what this process's main thread is doing (the stall report's answer).
* :mod:`hora.diagnostics.stall_report`: when to report a stall and the report's text.
* :mod:`hora.diagnostics.timeline`: Chrome-trace timeline per rank, merged at job end.
* :mod:`hora.launcher.check`: ``hora check``.

Nothing here but ``check`` (which reports torch's build) imports torch at module level, so the launcher can
import these modules cheaply.
"""

from __future__ import annotations

from hora.diagnostics.timeline import start_timeline, stop_timeline

__all__ = ["start_timeline", "stop_timeline"]
