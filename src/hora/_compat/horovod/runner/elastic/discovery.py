"""``horovod.runner.elastic.discovery`` on hora: the host discovery classes a user subclasses or gives an elastic
Ray executor (``settings.discovery``)."""

from __future__ import annotations

from hora.launcher.elastic.hosts import FixedHosts, HostDiscovery, HostDiscoveryScript  # noqa: F401

__all__ = ["FixedHosts", "HostDiscovery", "HostDiscoveryScript"]
