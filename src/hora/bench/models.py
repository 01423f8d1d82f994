"""Models for ``hora bench model``, defined here so the benchmark needs nothing beyond torch.

* ``mlp``: a tiny multilayer perceptron (about 0.4 M parameters): communication-light, for smoke tests;
* ``wide-mlp``: four hidden layers of 2900 units (26 M parameters, ResNet-50's ~100 MB of gradients for a
  fraction of its compute): communication-bound, to see the network;
* ``resnet50``: ResNet-50's layout (bottleneck blocks 3-4-6-3, 25.6 M parameters, about 100 MB of float32
  gradients), the model Horovod's synthetic benchmark defaults to;
* ``resnet18``: the basic-block 2-2-2-2 layout (11.7 M parameters);
* any other name is looked up in ``torchvision.models`` when torchvision is installed.

Example:
    >>> model = build("mlp")
    >>> sum(p.numel() for p in model.parameters()) > 0
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from hora.errors import ConfigError

__all__ = ["BUILTIN", "build", "input_shape", "parameter_bytes"]


class MLP(nn.Module):
    """Flat inputs of ``features`` values, ``depth`` hidden layers of ``hidden`` units, ``classes`` outputs."""

    def __init__(self, features: int = 256, hidden: int = 512, classes: int = 10, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))  # type: ignore[no-any-return]


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)]


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(*_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                                  *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                                  *_conv_bn(width, cout, 1))
        self.skip = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3))
        self.skip = nn.Sequential(*_conv_bn(cin, width, 1, stride)) if stride != 1 or cin != width else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """The ImageNet ResNet layout: a 7x7 stem, four stages of blocks, global pooling, one linear layer."""

    def __init__(self, block: type[Bottleneck] | type[Basic], depths: tuple[int, int, int, int],
                 classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for stage, depth in enumerate(depths):
            width = 64 * 2**stage
            for i in range(depth):
                layers.append(block(cin, width, 2 if i == 0 and stage > 0 else 1))
                cin = width * block.expansion
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))  # type: ignore[no-any-return]


BUILTIN: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "wide-mlp": lambda: MLP(hidden=2900, depth=4),
    "resnet50": lambda: ResNet(Bottleneck, (3, 4, 6, 3)),
    "resnet18": lambda: ResNet(Basic, (2, 2, 2, 2)),
}


def build(name: str) -> nn.Module:
    """A fresh model by name: built-in first, then ``torchvision.models.<name>`` when torchvision is there."""
    if name in BUILTIN:
        return BUILTIN[name]()
    try:
        tv = importlib.import_module("torchvision.models")
    except ImportError:
        raise ConfigError(f"--model {name}: not a built-in model ({', '.join(BUILTIN)}) and torchvision is not "
                          "installed (pip install torchvision for its models)") from None
    factory = getattr(tv, name, None)
    if not callable(factory):
        raise ConfigError(f"--model {name}: neither built in ({', '.join(BUILTIN)}) nor in torchvision.models")
    return factory()  # type: ignore[no-any-return]


def input_shape(name: str, image_size: int) -> tuple[int, ...]:
    """The shape of one synthetic sample for the model."""
    return (256,) if name.endswith("mlp") else (3, image_size, image_size)


def classes(name: str) -> int:
    return 10 if name.endswith("mlp") else 1000


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the gradients one step reduces."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
