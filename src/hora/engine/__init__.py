"""The negotiation engine: how the ranks agree, each round, which collectives are ready and in what order.

``plan`` (requests, the table, the decision), ``response_cache`` (the bit-vector fast path), ``mesh`` and
``control`` (the control planes and the stall watchdog), ``dispatch`` (launching the agreed collectives in
order) and ``negotiator`` (the rounds). See docs/architecture.md.
"""
