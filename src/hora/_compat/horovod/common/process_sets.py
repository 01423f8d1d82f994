"""``horovod.common.process_sets`` under ``hora run``."""

from __future__ import annotations

from hora.common.process_sets import ProcessSet, global_process_set  # noqa: F401
from hora.runtime.lifecycle import add_process_set, remove_process_set  # noqa: F401
