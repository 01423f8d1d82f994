"""pytest plugins of hora's own suite, registered by ``tests/conftest.py``: what CI demands of a run
(:mod:`.skips`), no process left behind by a test (:mod:`.leaks`), and a run that names what it is doing
(:mod:`.progress`)."""
