"""TorchState's save/restore in one process: a commit reuses the saved copy's memory, and a restore never ties
the saved commit to the live optimizer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hora.elastic import TorchState


def _step(model: nn.Module, opt: torch.optim.Optimizer, scale: float) -> None:
    opt.zero_grad()
    F.mse_loss(model(torch.ones(4, 3) * scale), torch.zeros(4, 2)).backward()
    opt.step()


def _saved_tensors(state: TorchState) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for handler in state._handlers.values():
        walk(handler._saved)  # type: ignore[attr-defined]
    return found


def test_save_overwrites_the_last_copy_instead_of_allocating() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, opt)
    _step(model, opt, 1.0)
    state.save()  # the momentum buffers appear: new tensors once
    before = [t.data_ptr() for t in _saved_tensors(state)]
    _step(model, opt, 2.0)
    state.save()
    after = _saved_tensors(state)
    assert [t.data_ptr() for t in after] == before
    assert torch.equal(after[0], model.weight) and torch.equal(after[1], model.bias)
    assert torch.equal(after[2], opt.state[model.weight]["momentum_buffer"])


def test_restore_gives_the_commit_back_every_time() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, opt, epoch=0)
    _step(model, opt, 1.0)
    state.epoch = 1
    state.save()
    committed = (model.weight.clone(), opt.state[model.weight]["momentum_buffer"].clone())
    for scale in (2.0, 3.0):  # train past the commit, then fail: twice in a row
        _step(model, opt, scale)
        state.epoch = 7
        state.restore()
        assert torch.equal(model.weight, committed[0])
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], committed[1])
        assert state.epoch == 1


def test_save_follows_a_state_whose_shape_changed() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = TorchState(model, opt)
    _step(model, opt, 1.0)
    state.save()
    state.model = nn.Linear(3, 5)  # a new object for the attribute: tracked from now on
    state.save()
    assert _saved_tensors(state)[0].shape == (5, 3)
