"""What every worker-side layer (and the launcher's environment reading) shares: the environment (:mod:`.env`, the
only reader of ``os.environ``), the tuning knobs (:mod:`.knobs`), Slurm's lists, process sets, the collective names
hora reserves, and the rendezvous store (:mod:`.rendezvous`).
"""
