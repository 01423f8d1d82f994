"""A tiny GPT-2 fine-tuned by transformers' Trainer: ``hora run -np 2 python hf_job.py OUT`` (HoraTrainer), or
``python hf_job.py OUT --reference`` (the plain Trainer in one process on the ranks' batches together).

Writes ``OUT/rank<r>.json`` (losses, what the Trainer saw, the dataset indices this rank read) and
``OUT/params-rank<r>.pt`` (the trained parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

VOCAB, LENGTH, SAMPLES = 64, 16, 64


class Sequences(torch.utils.data.Dataset):
    """Counting sequences mod VOCAB with a random start and stride: next-token prediction is learnable."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
        strides = torch.randint(1, 4, (SAMPLES, 1), generator=g)
        self.ids = (starts + strides * torch.arange(LENGTH)) % VOCAB
        self.read: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--sharding", default=None)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--no-use-cpu", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0, help="save a Trainer checkpoint every so many steps")
    parser.add_argument("--resume", default=None, help="a Trainer checkpoint folder to resume from")
    opts = parser.parse_args(argv)
    per_rank_batch, ranks = 4, 2
    common = dict(output_dir=str(opts.out / "trainer"), gradient_accumulation_steps=2, learning_rate=3e-3,
                  num_train_epochs=opts.epochs, logging_steps=1, report_to=[],
                  save_strategy="steps" if opts.save_steps else "no", save_steps=opts.save_steps or 500,
                  use_cpu=not opts.no_use_cpu, max_grad_norm=opts.max_grad_norm, seed=0, disable_tqdm=True,
                  lr_scheduler_type="constant")
    data = Sequences()
    if opts.reference:
        args = transformers.TrainingArguments(per_device_train_batch_size=per_rank_batch * ranks, **common)
        trainer = transformers.Trainer(model=model(), args=args, train_dataset=data)
        rank = 0
    else:
        import hora as hvd
        from hora.integrations.hf import HoraTrainer

        hvd.init()
        args = transformers.TrainingArguments(per_device_train_batch_size=per_rank_batch, **common)
        trainer = HoraTrainer(model=model(), args=args, train_dataset=data, sharding=opts.sharding)
        rank = hvd.rank()
    trainer.train(resume_from_checkpoint=opts.resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    report = {
        "losses": losses, "world_size": args.world_size, "process_index": args.process_index,
        "wrapped": type(trainer.model_wrapped).__name__, "optimizer": type(trainer.optimizer.optimizer).__name__,
        "sharding": getattr(trainer.optimizer.optimizer, "sharding", None),
        "read": data.read, "steps": trainer.state.global_step,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()}, opts.out / f"params-rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
