"""Fixtures for the multi-host tests: three hosts (node2..node4 at 10.78.0.2-4) built once per session.

The cluster is torn down whatever happens: at the end of the session (pytest runs session finalizers on
failures and on Ctrl-C), on SIGTERM (turned into KeyboardInterrupt while the cluster lives), and at interpreter
exit. A run killed with SIGKILL leaves namespaces behind; the next run removes them before building
(:func:`netns.clean_stale`).
"""

from __future__ import annotations

import atexit
import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from tests.cluster import netns


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[netns.Cluster]:
    """Three simulated hosts with sshd; skips (with the reason) when not root or tools are missing."""
    reason = netns.missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    built = netns.Cluster.build((2, 3, 4), tmp=tmp_path_factory.mktemp("cluster"))
    atexit.register(built.close)
    try:
        yield built
    finally:
        built.close()
        atexit.unregister(built.close)
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def hosts(cluster: netns.Cluster) -> Iterator[netns.Cluster]:
    """The session cluster, restored after each test: links up, every job process killed.

    Tests assert themselves that nothing was left running; this only stops one test's leftovers from
    breaking the next one.
    """
    yield cluster
    for host in cluster.hosts:
        host.link_up()
        host.kill_all()
