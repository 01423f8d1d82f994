"""Synthetic-data throughput benchmark: ResNet-50 (defined here, no torchvision) trained on random images.

Prints images per second per rank and in total, like Horovod's pytorch_synthetic_benchmark.py:

    hora run -np 2 python examples/resnet50_synthetic.py --batch-size 16 --num-iters 5
    hora run -np 8 -H a:4,b:4 python examples/resnet50_synthetic.py --fp16-allreduce
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hora as hvd


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 v1.5 (stride in the 3x3 conv): 25.6 M parameters, 161 parameter tensors."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, num_classes)
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradient compression")
    p.add_argument("--bf16-allreduce", action="store_true", help="bf16 gradient compression")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hvd.init()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    torch.manual_seed(0)
    model = ResNet50(args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    compression = (hvd.Compression.fp16 if args.fp16_allreduce else
                   hvd.Compression.bf16 if args.bf16_allreduce else hvd.Compression.none)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def say(msg: str) -> None:
        if hvd.rank() == 0:
            print(msg, flush=True)

    header = f"Model: ResNet-50, batch size {args.batch_size}, ranks {hvd.size()}, compression {compression}"
    say(header)
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for i in range(args.num_iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t0)
        say(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean = statistics.fmean(rates)
    spread = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    total = float(hvd.allreduce(torch.tensor(mean), name="img_per_sec", op=hvd.Sum))
    say(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    say(f"Total img/sec on {hvd.size()} rank(s): {total:.1f}")
    return {"img_per_sec_per_rank": mean, "img_per_sec_total": total, "header": header}


if __name__ == "__main__":
    main()
