"""``horovod.runner.elastic.worker`` under ``hora run``: the host-update result and the notification manager."""

from __future__ import annotations

from hora.elastic.notifications import HostUpdateResult, WorkerNotificationManager  # noqa: F401
