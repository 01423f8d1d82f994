"""``horovod.common.exceptions`` under ``hora run``: hora's error types under Horovod's names."""

from __future__ import annotations

from hora.errors import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
