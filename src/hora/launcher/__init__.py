"""The launch side of hora: ``hora run``, ``hora.run(fn)``, and what ``hora.ray`` and ``hora.spark`` run on.

Driver (this process) -> a handle per batch of workers (an agent per host, local or over ssh; a framework's
actors or tasks) -> workers. The parts, top down (the import-linter contract ``launcher-layers`` keeps them so):

* ``cli`` (``hora run``, ``hora check``) and ``pyfunc`` (``hora.run(fn)``: ship a function, collect the results).
* ``fixed`` and ``elastic``: the drivers of a fixed-size job and of an elastic one.
* ``supervision``: the one run loop every driver is (``loop``), the one rule that names a failed job's root cause
  (``root_cause``), the drivers' side of the stall board (``stall_watch``).
* ``remote``: reaching hosts: the per-host agent and the driver's handle on it, transports, preflight.
* beside them: ``config`` (the frozen :class:`RunConfig`), ``hosts`` (``-H``/hostfile, slot assignment),
  ``envvars`` (each worker's environment), ``procs`` (process groups, signals), ``output`` (the console and
  logs), ``output_lock``, ``check``, ``frameworks`` (what ``hora.ray`` and ``hora.spark`` share).

Nothing here imports torch at module level or the worker-side core, so the agent stays light.
"""
