"""A pytest plugin loaded into the run of Horovod 0.28.1's own Ray test files (tests/frameworks/test_horovod_suites.py),
for the one thing in them that today's Ray refuses: ``ray.init(_redis_max_memory=...)`` (test_ray.py's
``ray_start_4_cpus`` fixture; Ray 2.x has no Redis to size). The argument is dropped; nothing else is changed."""

from __future__ import annotations

from typing import Any

import ray

_ray_init = ray.init


def _init(*args: Any, **kwargs: Any) -> Any:
    kwargs.pop("_redis_max_memory", None)
    return _ray_init(*args, **kwargs)


ray.init = _init
