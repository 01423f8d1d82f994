"""hora.meta.materialize refuses models whose memory it would leave uninitialised, and says what to pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hora.meta import materialize, non_persistent_buffers


class Scaled(nn.Module):
    """A layer with a parameter of its own and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        self.freqs.copy_(torch.arange(4.0))


def test_materialize_without_processes_fills_torch_layers_in_place() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert materialize(model) is model
    assert model[0].weight.device.type == "cpu" and torch.equal(model[1].weight, torch.ones(4))


def test_a_model_partly_off_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    model.append(nn.Linear(4, 2))  # built outside the meta block: to_empty would wipe its values
    with pytest.raises(ValueError, match=r"1\.weight.*build the whole model under"):
        materialize(model)


def test_a_layer_without_reset_parameters_needs_init() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled())
    with pytest.raises(ValueError, match=r"\b1 hold tensors of their own.*Pass init="):
        materialize(model)

    def init() -> None:
        model[0].reset_parameters()
        model[1].scale.fill_(2.0)

    materialize(model, init=init)
    assert torch.equal(model[1].scale, torch.full((4,), 2.0))


def test_computed_buffers_need_init_even_with_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Rotary())
    assert non_persistent_buffers(model) == ["1.freqs"]
    with pytest.raises(ValueError, match=r"computed at construction.*1\.freqs.*init="):
        materialize(model)
