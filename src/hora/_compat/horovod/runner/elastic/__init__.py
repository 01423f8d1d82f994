"""``horovod.runner.elastic`` under ``hora run``: only what a training script imports (``worker``)."""
