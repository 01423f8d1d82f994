"""The running world of one process: ``init()`` / ``shutdown()`` (:mod:`.lifecycle`, with :mod:`.bootstrap`), the
rendezvous store, an elastic worker's place in the newest world, and a newcomer's first collective.
"""
