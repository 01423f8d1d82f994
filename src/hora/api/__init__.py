"""The public collectives and helpers: what ``hvd.allreduce``, ``hvd.grouped_allreduce``, ``hvd.broadcast_parameters``
and the build queries are (re-exported by :mod:`hora`). Each builds a call and submits it through :mod:`hora.calls`.
"""
