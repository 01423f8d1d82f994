"""From a user's call to the engine: a :class:`~hora.datapath.kinds.Call` built from Horovod's arguments
(:mod:`.from_args`), validated, named and handed to the negotiator (:mod:`.submit`).
"""
