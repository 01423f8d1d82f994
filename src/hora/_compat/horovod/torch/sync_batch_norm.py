"""``horovod.torch.sync_batch_norm`` under ``hora run``."""

from __future__ import annotations

from hora.training.sync_batch_norm import SyncBatchNorm  # noqa: F401
