"""What every worker-side layer (and the launcher's env reading) shares: the environment (:mod:`.env`, the only
reader of ``os.environ``, and the knobs), Slurm's lists, process sets, and the collective names hora reserves.
"""
