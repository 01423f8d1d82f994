"""``horovod.torch.elastic`` under ``hora run``: :mod:`hora.elastic` (``.state`` and ``.sampler`` too)."""

from __future__ import annotations

import hora.elastic as _elastic

globals().update({_name: getattr(_elastic, _name) for _name in dir(_elastic) if not _name.startswith("_")})
