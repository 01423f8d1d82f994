"""``hora bench``: measure a cluster with hora, under ``hora run`` like any training script.

* ``hora bench allreduce``: a sweep of message sizes with algbw and busbw as nccl-tests define them, hora's
  allreduce against raw ``torch.distributed.all_reduce`` in the same run (:mod:`hora.bench.sweep`);
* ``hora bench model``: synthetic-data training throughput and scaling efficiency against one rank
  (:mod:`hora.bench.model`, models in :mod:`hora.bench.models`);
* ``hora bench plan``: an alpha-beta model per link type fitted to a sweep, predicting step time and
  scaling efficiency (:mod:`hora.bench.planner`).

Every ratio comes from one run that alternates the variants, rotating which goes first each cycle
(:func:`hora.bench.timing.alternate`).
"""
