"""``horovod.runner.util.network`` on hora: ``get_driver_ip`` (hora's Ray and Spark drivers serve their store on the
address their engine gives them; this is the address a script may name itself)."""

from __future__ import annotations

from hora.protocol.network import get_driver_ip  # noqa: F401

__all__ = ["get_driver_ip"]
