"""Training on top of the collectives: ``DistributedOptimizer`` (its gradient reducers and buckets) and
``SyncBatchNorm``.
"""
