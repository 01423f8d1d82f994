"""Fine-tuning a causal language model on hora: sharded optimizer state, bf16, accumulation, clipping, sharded
checkpoints, elastic-ready.

A GPT-2- or Llama-style model built from a config (or loaded shard by shard with --pretrained DIR), trained on
synthetic token sequences with AdamW under ``hvd.DistributedOptimizer(sharding=...)``; every --checkpoint-every
steps a sharded checkpoint (each rank writes its own part) that a later run resumes from, at any number of ranks.
Needs ``pip install 'hora[hf]'``. docs/large-models.md explains each choice.

    hora run -np 2 python examples/finetune_lm.py --model llama --sharding gradients --bf16 \\
        --accumulate 4 --checkpoint-dir /checkpoints/lm
    hora run -np 4 --min-np 2 -H a:2,b:2 python examples/finetune_lm.py ...   # elastic: survives a lost host
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Any

import torch
import transformers

import hora as hvd
from hora import checkpoint
from hora.meta import materialize

log = logging.getLogger("finetune_lm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", choices=["gpt2", "llama"], default="llama")
    p.add_argument("--pretrained", default=None, help="a Hugging Face model directory to start from instead")
    p.add_argument("--meta", action="store_true", help="build on the meta device and materialise (no second copy)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all (a resumed run goes on to it)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and micro-batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--sharding", choices=["none", "optimizer", "gradients"], default="optimizer")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for forward and backward")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints and elastic commits")
    p.add_argument("--async-checkpoint", action="store_true", help="write checkpoints while training goes on")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model, holding its weights once: from --pretrained shard by shard, or from a config (on the meta
    device then materialised with rank 0's values, or built directly with the same seed on every rank)."""
    if args.pretrained:
        return transformers.AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32, use_cache=False)
    if args.model == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
            use_cache=False)
    else:
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=args.seq_len, use_cache=False)
    torch.manual_seed(0)
    if not args.meta:
        return transformers.AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return materialize(model, init=model.init_weights)


def batch(step: int, micro: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's micro-batch of a step: counting sequences mod vocab with random starts and strides."""
    g = torch.Generator().manual_seed(((step * 1000 + micro) * 1000 + hvd.rank()) * 1000 + hvd.size())
    starts = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    strides = torch.randint(1, 4, (args.batch_size, 1), generator=g)
    return (starts + strides * torch.arange(args.seq_len)) % args.vocab  # (B, T)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(args).to(device)  # materialize() put it there already; from_pretrained on the CPU
    if args.activation_checkpointing:
        model.activation_checkpointing_enable()  # recompute activations in backward: less memory
    model.train()
    sharding = None if args.sharding == "none" else args.sharding
    optimizer = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01),
        named_parameters=model.named_parameters(), backward_passes_per_step=args.accumulate, sharding=sharding)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))  # warm-up
    start = 0
    if args.checkpoint_dir:
        resumed = checkpoint.restore_sharded(args.checkpoint_dir, model=model, optimizer=optimizer,
                                             scheduler=scheduler)
        start = resumed or 0
    if not start and not args.meta and not args.pretrained:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # materialize() and a checkpoint already did

    def autocast() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()

    losses: list[float] = []
    pending: Any = None

    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, step=start)

    @hvd.elastic.run
    def train(state: Any) -> None:
        nonlocal pending
        while state.step < args.steps:
            optimizer.zero_grad()
            total = 0.0
            for micro in range(args.accumulate):
                ids = batch(state.step, micro, args).to(device)
                with autocast():
                    loss = model(input_ids=ids, labels=ids).loss / args.accumulate
                loss.backward()
                total += loss.item()
            if args.clip > 0:
                optimizer.clip_grad_norm_(args.clip)  # the norm over all ranks' gradients, whatever the sharding
            with optimizer.skip_synchronize():
                optimizer.step()
            scheduler.step()
            state.step += 1
            losses.append(hvd.allreduce(torch.tensor(total), name="loss").item())
            if hvd.rank() == 0 and (state.step % 5 == 0 or state.step == args.steps):
                print(f"step {state.step}: loss {losses[-1]:.4f} on {hvd.size()} ranks", flush=True)
            if state.step % args.checkpoint_every == 0 or state.step == args.steps:
                if args.checkpoint_dir:
                    pending = checkpoint.save_sharded(args.checkpoint_dir, state.step, model=model,
                                                      optimizer=optimizer, scheduler=scheduler,
                                                      async_save=args.async_checkpoint)
                state.commit()  # an in-memory copy for elastic resets (the model's is whole: docs/large-models.md)
            else:
                state.check_host_updates()

    train(state)
    if isinstance(pending, checkpoint.AsyncSave):
        pending.wait()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "start": start, "step": state.step, "size": hvd.size(), "rank": hvd.rank(),
            "checksum": float(params.double().sum()), "owned": len(optimizer.owned_parameter_names()),
            "params": len(list(model.parameters()))}


if __name__ == "__main__":
    main(sys.argv[1:])
