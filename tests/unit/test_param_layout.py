"""broadcast_parameters' message for models that differ across ranks (the pure part, hora.api.param_layout)."""

from __future__ import annotations

import torch
from torch import nn

from hora.api.param_layout import describe_mismatch, fingerprint, layout


def test_the_fingerprint_ignores_names_but_not_shapes_or_dtypes() -> None:
    model = nn.Linear(4, 3)
    plain = layout(list(model.state_dict().items()))
    wrapped = layout([(f"module.{k}", v) for k, v in model.state_dict().items()])  # a DDP copy's names
    assert fingerprint(plain) == fingerprint(wrapped)
    assert fingerprint(plain) != fingerprint(layout(list(nn.Linear(4, 2).state_dict().items())))
    assert fingerprint(plain) != fingerprint(layout(list(nn.Linear(4, 3).double().state_dict().items())))


def test_ranks_with_the_same_difference_are_named_together_with_what_differs() -> None:
    root = layout(list(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict().items()))
    wide = layout(list(nn.Sequential(nn.Linear(4, 9), nn.Linear(9, 2)).state_dict().items()))
    extra = layout(list(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2)).state_dict().items()))
    message = describe_mismatch({0: root, 1: wide, 2: root, 3: wide, 4: extra}, root_rank=0)
    lines = message.split("\n")
    assert lines[1] == ("  ranks 1, 3: '0.weight' has shape [9, 4] here, [8, 4] on rank 0; '0.bias' has shape [9] "
                        "here, [8] on rank 0; '1.weight' has shape [2, 9] here, [2, 8] on rank 0")
    assert lines[2] == ("  rank 4: '2.weight' ([2, 2]) is not in rank 0's model; '2.bias' ([2]) is not in rank 0's "
                        "model")
    assert "rank 2" not in message


def test_unnamed_tensors_are_compared_by_position_and_dtypes_are_named() -> None:
    root = layout([("#0", torch.zeros(3)), ("#1", torch.zeros(2))])
    other = layout([("#0", torch.zeros(3, dtype=torch.float64)), ("#1", torch.zeros(5))])
    message = describe_mismatch({1: root, 0: other}, root_rank=1)
    assert "rank 0: '#0' has dtype float64 here, float32 on rank 1; '#1' has shape [5] here, [2] on rank 1" in message
    renamed = layout([("module.w", torch.zeros(4))])
    message = describe_mismatch({0: layout([("w", torch.zeros(3))]), 1: renamed}, root_rank=0)
    assert "tensor #0 'module.w' (rank 0: 'w') is [4] float32 here, [3] float32 on rank 0" in message
