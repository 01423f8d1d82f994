"""Supervising a job: the one run loop every driver is (``loop``: :class:`~hora.launcher.supervision.loop.JobLoop`,
its public steps and the handles it watches), the one rule that names a failed job's root cause (``root_cause``),
and the drivers' side of the board the ranks post stalls on (``stall_watch``).

Every job hora starts goes through them: ``hora run``'s fixed and elastic drivers (``hora.run(fn)`` too),
``hora.ray``'s executors and ``hora.spark.run``.
"""
