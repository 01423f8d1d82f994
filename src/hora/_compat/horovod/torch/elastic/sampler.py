"""``horovod.torch.elastic.sampler`` under ``hora run``: :mod:`hora.elastic.sampler`."""

from __future__ import annotations

from hora.elastic.sampler import ElasticSampler  # noqa: F401
