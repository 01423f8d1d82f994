"""The negotiation engine: how the ranks agree, each round, which collectives are ready and in what order.

Three parts, each a package: :mod:`~hora.engine.scheduling` (the negotiator, its rounds, the table, what is
pending, launching what a round decided, the handles), :mod:`~hora.engine.transport` (the control planes that
carry a round's frames: the TCP mesh, the Gloo plane, their schedules and failures) and :mod:`~hora.engine.auth`
(proving both ends of a control connection and sealing its frames). What all three share sits here:
:mod:`~hora.engine.context` (all the engine gets from the runtime) and :mod:`~hora.engine.codec` (the plain-value
byte format). See docs/architecture.md.
"""
