"""Elastic training: lose or gain hosts mid-run without restarting anyone (Horovod's ``hvd.elastic`` API).

    import hora as hvd                       # or: import horovod.torch as hvd
    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...                                  # state.commit() every few steps

    train(state)

Run it with ``hora run --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py`` (see
docs/elastic.md). The retry loop is :mod:`hora.elastic.loop`, the states and their handlers
:mod:`hora.elastic.state`, the sampler :mod:`hora.elastic.sampler`, how host changes reach the states
:mod:`hora.elastic.notifications`; the rendezvous with the launcher is :mod:`hora.runtime.elastic_rendezvous`, a
worker that starts while the job runs :mod:`hora.runtime.newcomer`.
"""

from __future__ import annotations

from hora.elastic.loop import run
from hora.elastic.sampler import ElasticSampler
from hora.elastic.state import ObjectState, State, TorchState
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]
