"""From a user's call to the engine: a :class:`~hora.calls.call.Call` built from Horovod's arguments (:mod:`.call`),
validated, named, prepared and handed to the negotiator (:mod:`.submit`).
"""
