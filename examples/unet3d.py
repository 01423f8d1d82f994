"""3D U-Net segmentation on generated volumes, with checkpoints to a shared directory and resume.

A medical segmentation case in miniature: each sample is a noisy volume holding a few bright blobs;
the target is the blob mask. Normalisation is ``hvd.SyncBatchNorm`` (statistics over the global batch,
as small 3D batches need). Rank 0 writes ``<checkpoint-dir>/ckpt-<step, 9 digits>.pt`` (``ckpt-000000040.pt``)
with hora.checkpoint every ``--checkpoint-every`` steps (atomically: write, then rename); a restarted job
resumes from the latest, on any number of ranks:

    hora run -np 2 python examples/unet3d.py --steps 40 --checkpoint-dir /data/ckpt
    hora run -np 2 python examples/unet3d.py --steps 80 --checkpoint-dir /data/ckpt    # resumes at step 40
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import hora as hvd
from hora import checkpoint


class Blobs(Dataset):
    """``count`` volumes of shape (1, S, S, S): 1-3 spheres of value ~1 in noise; the mask is the label."""

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count, self.size, self.seed = count, size, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        s = self.size
        grid = torch.stack(torch.meshgrid(*[torch.arange(s, dtype=torch.float32)] * 3, indexing="ij"))  # (3,S,S,S)
        mask = torch.zeros(s, s, s)
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            centre = torch.rand(3, generator=g) * (s - 4) + 2
            radius = float(torch.rand(1, generator=g)) * s / 6 + 1.5
            mask = torch.maximum(mask, (((grid - centre.view(3, 1, 1, 1)) ** 2).sum(0) <= radius**2).float())
        volume = mask + 0.3 * torch.randn(s, s, s, generator=g)
        return volume.unsqueeze(0), mask.unsqueeze(0)


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False), hvd.SyncBatchNorm(cout), nn.ReLU(inplace=True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False), hvd.SyncBatchNorm(cout), nn.ReLU(inplace=True),
    )


class UNet3D(nn.Module):
    """Two-level 3D U-Net: (B, 1, S, S, S) -> logits (B, 1, S, S, S); S divisible by 4."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.enc1, self.enc2, self.mid = block(1, width), block(width, 2 * width), block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose3d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose3d(2 * width, width, 2, stride=2)
        self.dec1 = block(2 * width, width)
        self.head = nn.Conv3d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)                      # (B, w, S, S, S)
        e2 = self.enc2(F.max_pool3d(e1, 2))    # (B, 2w, S/2, ...)
        m = self.mid(F.max_pool3d(e2, 2))      # (B, 4w, S/4, ...)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.head(d1)


def dice(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    pred = torch.sigmoid(logits)
    inter = (pred * mask).sum()
    return (2 * inter + 1) / (pred.sum() + mask.sum() + 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps (including resumed ones)")
    p.add_argument("--batch-size", type=int, default=2, help="volumes per rank per step")
    p.add_argument("--volume-size", type=int, default=16)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by hvd.size()")
    p.add_argument("--checkpoint-dir", default="", help="shared directory for checkpoints (empty: none)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--fp16-allreduce", action="store_true")
    return p.parse_args(argv)


def restore(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank loads the newest complete checkpoint (rank 0 chooses it); returns the step to start from."""
    state = checkpoint.restore(directory) if directory else None
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hvd.init()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    torch.manual_seed(0)
    model = UNet3D().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    start = restore(args.checkpoint_dir, model, optimizer)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    data = Blobs(args.num_samples, args.volume_size, seed=1)
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    if hvd.rank() == 0:
        print(f"3D U-Net on {hvd.size()} rank(s): steps {start} -> {args.steps}", flush=True)

    step, epoch, score = start, start * args.batch_size * hvd.size() // len(data), torch.tensor(0.0)
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step >= args.steps:
                break
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y) + 1 - dice(logits, y)
            loss.backward()
            optimizer.step()
            step += 1
            score = hvd.allreduce(dice(logits.detach(), y).cpu(), name="dice")
            if args.checkpoint_dir and step % args.checkpoint_every == 0:  # rank 0 writes, atomically
                checkpoint.save(args.checkpoint_dir, step, {"step": step, "model": model.state_dict(),
                                                            "optimizer": optimizer.state_dict()})
            if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps):
                print(f"step {step}: loss {loss.item():.4f}  dice (averaged over ranks) {float(score):.3f}",
                      flush=True)
        epoch += 1
    return {"start": start, "step": step, "dice": float(score)}


if __name__ == "__main__":
    main()
