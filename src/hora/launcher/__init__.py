"""The launch side of hora: ``hora run`` and ``hora.run(fn)``.

Driver (this process) -> one agent per host (local or over ssh) -> workers. The modules, by concept:

* ``cli``: argparse, subcommands, flag suggestions; ``config``: the frozen :class:`RunConfig`.
* ``hosts``: ``-H``/hostfile parsing and slot assignment (pure).
* ``envvars``: what each worker's environment holds (addresses and interfaces: :mod:`hora.protocol.network`).
* ``transport``: how an agent is started on a host (local process or ssh); ``preflight``: host checks.
* ``driver``: runs a job end to end; ``agent``: spawns and watches the workers on one host.
* ``procs``: process groups and signals; ``protocol``: agent <-> driver messages; ``output``: console/logs.
* ``elastic_protocol``: the store keys and records (worlds, host updates) an elastic job's driver and workers share.
* ``pyrun``/``pyworker``/``shipping``: ``hora.run(fn)``, running a Python function on every rank.

Nothing here imports torch at module level or the worker-side core, so the agent stays light.
"""
