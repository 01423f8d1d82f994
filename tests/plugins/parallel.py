"""How the suite splits across pytest-xdist workers (``make test`` runs ``-n 2 --dist loadgroup``).

Tests that share a machine-wide resource built once per session stay together on one worker: the deployment
tests (one podman image build, podman's storage, the Slurm cluster's ports) and the multi-host tests (one
namespace cluster per session). Everything else is spread over the workers by load. Without xdist these
marks do nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GROUPS = {"deploy": "deploy", "cluster": "cluster"}  # tests/<directory> -> the worker group its tests share


def group_of(path: Path) -> str | None:
    parts = path.parts
    if "tests" not in parts:
        return None
    index = parts.index("tests")
    return GROUPS.get(parts[index + 1]) if len(parts) > index + 2 else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = group_of(item.path)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
