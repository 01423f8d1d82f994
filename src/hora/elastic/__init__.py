"""Horovod Elastic (``hvd.elastic.run``, ``State``, ``ElasticSampler``) is not part of hora yet.

Importing this module fails with an explanation instead of a bare ModuleNotFoundError, so a Horovod script
that uses elastic training learns at once what to change. ``hora run``'s elastic flags (``--min-np`` ...)
are refused the same way.
"""

from __future__ import annotations

raise ImportError(
    "hora does not implement Horovod Elastic yet (hvd.elastic.run, TorchState, ElasticSampler): run the script "
    "without elastic (a fixed -np) and survive node loss by resuming from checkpoints on shared storage "
    "(hora.checkpoint, see docs/deploy.md)"
)
