"""A synthetic-data training benchmark that behaves like Horovod's examples/pytorch/pytorch_synthetic_benchmark.py
(written for hora from that example's documented flags and output, not copied): ``import horovod.torch as hvd``,
a model on random images, the DistributedOptimizer, warm-up batches, then timed iterations of several batches,
and the same summary lines ("Img/sec per GPU", "Total img/sec on N GPU(s)").

The model comes from torchvision when it is installed (as in Horovod's example), else from hora's built-in
definitions (resnet50, resnet18, mlp). ``--image-size`` (not in Horovod's example, default its 224) makes
CPU runs short.

    hora run -np 2 python benchmarks/pytorch_synthetic_benchmark.py --model resnet50 --batch-size 32
"""

from __future__ import annotations

import argparse
import timeit

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

from hora.bench import models as builtin

try:
    from torchvision import models as tv_models
except ImportError:
    tv_models = None


def build_model(name: str) -> torch.nn.Module:
    if tv_models is not None and hasattr(tv_models, name):
        return getattr(tv_models, name)()  # type: ignore[no-any-return]
    return builtin.build(name)


def main() -> None:
    p = argparse.ArgumentParser(description="PyTorch synthetic benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression in allreduce")
    p.add_argument("--model", type=str, default="resnet50", help="model to benchmark")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    p.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    p.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
    p.add_argument("--image-size", type=int, default=224, help="side of the synthetic images (hora's addition)")
    args = p.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())

    model = build_model(args.model)
    lr_scaler = 1 if args.use_adasum else hvd.size()
    if args.cuda:
        model.cuda()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    shape = builtin.input_shape(args.model, args.image_size)
    data = torch.randn(args.batch_size, *shape)
    target = torch.LongTensor(args.batch_size).random_() % builtin.classes(args.model)
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s: str) -> None:
        if hvd.rank() == 0:
            print(s, flush=True)

    device = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
