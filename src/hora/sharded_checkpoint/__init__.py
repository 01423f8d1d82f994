"""Sharded checkpoints on ``torch.distributed.checkpoint``, re-exported by :mod:`hora.checkpoint`:
:func:`save_sharded` (every rank writes its part, atomically published, optionally in the background) and
:func:`restore_sharded` (at any number of ranks). docs/large-models.md says when to use them.
"""

from hora.sharded_checkpoint.save_restore import (
    AsyncSave,
    clear_stale_sharded,
    restore_sharded,
    save_sharded,
    sharded_checkpoints,
)

__all__ = ["AsyncSave", "clear_stale_sharded", "restore_sharded", "save_sharded", "sharded_checkpoints"]
